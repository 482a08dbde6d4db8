"""Mistral (v0.2 on, Nemo, Small): Llama's tensors and names without biases, full attention
(``sliding_window: null``; a window is refused on import, see ``hfconfig.py``). Registered before
Llama, so a plain model exports as Llama unless ``--hf-arch mistral`` asks for this one."""

from tenplex_megatron.formats.hf.family import DENSE_NAMES, Family, register

MISTRAL = register(Family(
    name="mistral",
    architecture="MistralForCausalLM",
    names=DENSE_NAMES,
    config={"sliding_window": lambda m: None},
))
