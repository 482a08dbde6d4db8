"""The worker (mcore_worker.py) with the MoE tests' defaults: rope, vocab 128 padded to 16, 8 tokens.

Experts (EP, expert TP), virtual pipeline (VPP) and context parallel (CP) are flags of the one
worker (its docstring lists them; facts behind them: integrations/megatron/NOTES.md section 8).
Launch with torchrun; world = tp*cp*dp*pp::

    W=integrations/megatron/tests/moe_worker.py
    MOE="--layers 4 --hidden 64 --heads 4 --query-groups 2 --ffn 96 --swiglu --position rope \\
         --untie --vocab 128 --make-vocab-size-divisible-by 16 --seq 8 --experts 4 --topk 2"
    torchrun --nproc_per_node=2 $W --ep 2 $MOE --save both --save-dir /tmp/x --logits-out /tmp/x/ref.pt
    torchrun --nproc_per_node=1 $W --ep 1 $MOE --load dist --load-dir /tmp/x/dist --logits-out /tmp/x/out.pt
"""

import sys

from mcore_worker import main

if __name__ == "__main__":
    sys.exit(main(preset="moe"))
