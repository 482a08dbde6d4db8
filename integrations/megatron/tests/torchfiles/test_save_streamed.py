"""``save_streamed``: the bytes of ``torch.save``, written while the tensors are produced one by one."""

import argparse
import gc
import weakref

import pytest
import torch

from tenplex_megatron.torchfiles.ptsave import save_streamed


def _state(seed: int):
    """A Megatron-like object: placeholders' real values, plus tensors saved as they are."""
    g = torch.Generator().manual_seed(seed)
    real = [torch.randn(300, 257, generator=g), torch.randn(0), torch.randint(0, 9, (1 << 20,), generator=g),
            torch.randn(3, dtype=torch.float64, generator=g).to(torch.bfloat16), torch.randn(17, 5, generator=g)]
    fixed = {"step": torch.tensor(3.0), "rng": torch.randint(0, 255, (5000,), dtype=torch.uint8, generator=g)}
    return real, fixed


def _obj(tensors, fixed):
    return {"args": argparse.Namespace(lr=1e-3, params_dtype=torch.bfloat16), "iteration": 7,
            "model": {"a.weight": tensors[0], "empty": tensors[1], "_extra_state": None},
            "optimizer": [{"step": fixed["step"], "ids": tensors[2]}, None],
            "chunks": ({"bf16": tensors[3]}, [tensors[4]]), "rng_state": [fixed["rng"]]}


def test_the_file_is_what_torch_save_writes(tmp_path):
    real, fixed = _state(0)
    ref, out = tmp_path / "ref" / "state.pt", tmp_path / "out" / "state.pt"  # the name is in the zip
    ref.parent.mkdir()
    out.parent.mkdir()
    torch.save(_obj(real, fixed), ref)
    placeholders = [torch.empty_like(t) for t in real]
    n = save_streamed(_obj(placeholders, fixed), str(out), placeholders, (t.clone() for t in real))
    assert out.read_bytes() == ref.read_bytes()
    assert n == out.stat().st_size
    back = torch.load(out, weights_only=False)
    assert torch.equal(back["model"]["a.weight"], real[0]) and torch.equal(back["chunks"][1][0], real[4])


def test_views_are_written_as_their_own_bytes(tmp_path):
    big = torch.arange(1000, dtype=torch.float32)
    placeholder = torch.empty(10, 10)
    save_streamed({"w": placeholder}, str(tmp_path / "v.pt"), [placeholder], [big[500:600].view(10, 10)])
    assert torch.equal(torch.load(tmp_path / "v.pt", weights_only=True)["w"], big[500:600].view(10, 10))


def test_each_tensor_is_released_once_written(tmp_path):
    placeholders = [torch.empty(1 << 18) for _ in range(6)]
    alive: list = []

    def produce():
        for i in range(len(placeholders)):
            gc.collect()
            assert not [j for j, ref in enumerate(alive) if ref() is not None], \
                f"tensor {i}: earlier tensors still held while the next is produced"
            t = torch.full((1 << 18,), float(i))
            alive.append(weakref.ref(t))
            yield t
            del t  # the generator's own reference
    save_streamed({"s": placeholders}, str(tmp_path / "r.pt"), placeholders, produce())
    back = torch.load(tmp_path / "r.pt", weights_only=True)["s"]
    assert [int(t[0]) for t in back] == list(range(6))


def test_a_wrong_size_or_order_is_an_error(tmp_path):
    a, b = torch.empty(4), torch.empty(8)
    with pytest.raises(RuntimeError, match="produced 12 bytes"):
        save_streamed({"a": a}, str(tmp_path / "s.pt"), [a], [torch.zeros(3)])
    with pytest.raises(RuntimeError, match="written before"):
        save_streamed({"a": a, "b": b}, str(tmp_path / "o.pt"), [b, a], [torch.zeros(8), torch.zeros(4)])
    with pytest.raises(RuntimeError, match="never written"):
        save_streamed({"a": a}, str(tmp_path / "n.pt"), [a, b], [torch.zeros(4), torch.zeros(8)])
