"""An HF import reads each needed byte once, whatever the target's tensor parallelism.

The Megatron writers build their files rank by rank; reading every HF
tensor whole for each rank read the checkpoint ``tp`` times over. Checked
on models transformers saves (Llama, Qwen2 with QKV biases, Qwen3-MoE with
q/k norms and experts):

- drawn byte runs of every Megatron tensor read by rows and columns
  (:mod:`tenplex_megatron.formats.hf.rows`) equal the same runs of the
  tensor built from whole HF tensors, and only the runs' bytes are read;
- ``hf -> megatron-legacy / megatron-dist`` at tp 2 and 4 reads at most
  1.05 x the bytes needed (counted at the file level), and its output is
  bit-equal to the output of whole-tensor reads.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from count_reads import counting
from tenplex.api import load_global
from tenplex_megatron.formats.hf import read as hf_read
from tenplex_megatron.formats.hf.read import open_hf

from inprocess_cli import tenplex

COMMON = dict(vocab_size=100, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8,
              tie_word_embeddings=False)
MODELS = {
    "llama": ("LlamaConfig", dict(intermediate_size=96)),
    "qwen2": ("Qwen2Config", dict(intermediate_size=96)),  # q, k, v biases
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=48, num_experts=4,
                                         num_experts_per_tok=2, head_dim=8)),  # q/k norms, experts
}


def _save(root, name: str, hidden: int, layers: int):
    import transformers

    cls, extra = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**COMMON, **extra, hidden_size=hidden, num_hidden_layers=layers)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(root / name))
    return root / name


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_small")
    return {name: open_hf(str(_save(root, name, 64, 2)), {"make_vocab_size_divisible_by": 128})
            for name in MODELS}


def _runs(data, nbytes: int):
    k = data.draw(st.integers(1, 4))
    starts = [data.draw(st.integers(0, nbytes - 1)) for _ in range(k)]
    ends = [data.draw(st.integers(s + 1, nbytes)) for s in starts]
    return np.array(starts, np.int64), np.array(ends, np.int64)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_runs_read_by_rows_equal_the_whole_tensor(small, monkeypatch, data):
    monkeypatch.setattr(hf_read, "PARTIAL_MIN_BYTES", 0)  # every record: the tiny models' tensors are small
    source = small[data.draw(st.sampled_from(sorted(small)))]
    path = data.draw(st.sampled_from(sorted(source.records)))
    record = source.records[path]
    whole, _ = source.fetch(record, None, None)
    flat = whole.reshape(-1).view(torch.uint8)
    starts, ends = _runs(data, flat.numel())
    got, read = source.fetch(record, starts, ends)
    assert got.shape == whole.shape and got.dtype == whole.dtype
    got = got.reshape(-1).view(torch.uint8)
    covered = np.zeros(flat.numel(), dtype=bool)
    item = whole.element_size()
    for s, e in zip(starts.tolist(), ends.tolist()):
        covered[s // item * item: -(-e // item) * item] = True  # whole elements
        assert torch.equal(got[s:e], flat[s:e]), (path, s, e)
    if hf_read.row_map(record, source.geo) is not None:  # read by rows: the runs' elements, padding not
        assert read <= covered.sum(), (path, read, int(covered.sum()))


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Llama and Qwen3-MoE with hidden 256: the projections exceed PARTIAL_MIN_BYTES as they are."""
    root = tmp_path_factory.mktemp("hf_wide")
    return {name: _save(root, name, 256, 2) for name in ("llama", "qwen3_moe")}


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@pytest.mark.parametrize("name,fmt,to", [
    ("llama", "megatron-legacy", "tp=4"),
    ("llama", "megatron-dist", "tp=2,pp=2"),
    ("qwen3_moe", "megatron-legacy", "dp=2,tp=2,ep=2,etp=1"),
])
def test_import_reads_each_needed_byte_once(wide, tmp_path, monkeypatch, name, fmt, to):
    src = wide[name]
    with counting(str(src)) as counter:
        done = tenplex("reshard", str(src), str(tmp_path / "out"), "--to", to, "--format", fmt, "--json")
    assert done.returncode == 0, done.stderr
    report = [line for line in done.stdout.splitlines() if line.startswith("{")][-1]
    needed = json.loads(report)["bytes_needed"]
    assert counter.uncounted == 0
    assert counter.bytes <= 1.05 * needed, (counter.bytes, needed)
    monkeypatch.setattr(hf_read, "PARTIAL_MIN_BYTES", float("inf"))  # every HF tensor read whole
    done = tenplex("reshard", str(src), str(tmp_path / "whole"), "--to", to, "--format", fmt)
    assert done.returncode == 0, done.stderr
    for out in ("out", "whole"):  # each as a tenplex store of the same config, to compare tensors
        done = tenplex("reshard", str(tmp_path / out), str(tmp_path / f"{out}.tenplex"), "--to", to,
                       "--format", "tenplex")
        assert done.returncode == 0, done.stderr
    assert _same(load_global(str(tmp_path / "out.tenplex")), load_global(str(tmp_path / "whole.tenplex")))
