"""A ``torch_dist`` checkpoint saved with ``singleton_local_shards`` is named, not misread.

megatron-core (0.14 and later) can save every layer, expert and SwiGLU half as a tensor of its own
(``metadata={"singleton_local_shards": True}``: NeMo 2's default; Megatron-LM saves with it off).
tenplex reads Megatron-LM's layout only; such a checkpoint, saved here by megatron-core 0.16.1
itself (the worker's ``R13_SINGLETON=1``), is refused in one line that names the setting, and
nothing is written. (On c65add9: "unknown key decoder.layers.0.self_attention.linear_qkv.
layer_norm_weight; ... not part of the model config", which sent the user to the wrong place.)
"""

import pytest

from inprocess_cli import run_cli
from mcore_helpers import WORKER, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def test_singleton_local_shards_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("R13_SINGLETON", "1")
    src = tmp_path / "src"
    torchrun(WORKER, 1, ["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "96", "--swiglu", "--vocab", "128",
                         "--make-vocab-size-divisible-by", "16", "--seq", "8", "--save", "dist", "--save-dir", str(src)])
    assert b"decoder.layers.0.mlp.linear_fc1.weight_w" in (src / ".metadata").read_bytes()  # per layer, a half
    done = run_cli(["reshard", str(src), str(tmp_path / "out"), "--to", "tp=1"])
    assert done.returncode == 1 and "saved with singleton_local_shards" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
