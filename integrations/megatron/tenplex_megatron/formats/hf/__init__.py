"""The ``hf`` format: Hugging Face ``transformers`` model directories, out of and into Megatron checkpoints.

- ``fields``: the settings beyond the model config (eps, rope, router), from Megatron's args;
- ``transforms``: the tensor maths, both ways; ``family`` and ``families/``: names, declared;
- ``mapping``: which tensor becomes which; ``export``: the streamed writer;
- ``plugin``: the ``tenplex.formats`` entry point ``HF``.
"""
