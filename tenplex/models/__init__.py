"""Example tree specs (GPT-style) and random state, for tests, benchmarks and examples."""

from tenplex.models.gpt import GPT3_175B, GPTSpec, gpt_tree
from tenplex.models.random import random_state

__all__ = ["GPT3_175B", "GPTSpec", "gpt_tree", "random_state"]
