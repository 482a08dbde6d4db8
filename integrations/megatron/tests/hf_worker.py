"""The worker (mcore_worker.py) as the Hugging Face tests and bench/hf_export.py launch it: the MoE
defaults (moe_worker.py), with the settings an HF export must carry given as flags of the one worker
(``--eps``, ``--rotary-base``, ``--rotary-interleaved``, ``--rope-scaling``, ``--qk-layernorm``,
``--add-qkv-bias``, ``--pre-softmax``, ``--distinct-experts``, ``--tokens-out``, ``--hf-save``).
Every setting is also put in the checkpoint's args under Megatron-LM's names.
"""

import sys

from mcore_worker import main

if __name__ == "__main__":
    sys.exit(main(preset="moe"))
