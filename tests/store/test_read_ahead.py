"""The streaming reshard reads neighbouring stored tensors of one file as one window.

Tensors of a tenplex store share checksum blocks with their neighbours; read one by one,
each shared block went out to the boundary cache and back in. Read as a window, the
blocks are fetched and verified once, and reads never reach tensors no target needs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import tenplex.store.execute as execute
from tenplex.api import load_global, reshard, save
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.store.blocks import MERGE_GAP
from tenplex.store.reader import StoreReader

from .helpers import assert_same_global


def _store(tmp_path, spec: GPTSpec, config: P, block: int):
    tree = gpt_tree(spec)
    state = random_state(tree, config, 5)
    save(f"{tmp_path}/a", tree, config, {r: materialize(tree, state, config, r) for r in range(config.world_size)},
         block=block)
    return tree, state, f"{tmp_path}/a"


def _count_fetches(monkeypatch) -> list:
    """``(file, runs)`` of each fetch of tensor data (not of a file's header, by ``read_bytes``)."""
    fetches, fetch, read_bytes, header = [], StoreReader._fetch, StoreReader.read_bytes, [0]

    def counting(self, key, frec, runs, *args):
        if not header[0]:
            fetches.append((key, len(runs)))
        return fetch(self, key, frec, runs, *args)

    def reading_header(self, *args):
        header[0] += 1
        try:
            return read_bytes(self, *args)
        finally:
            header[0] -= 1

    monkeypatch.setattr(StoreReader, "_fetch", counting)
    monkeypatch.setattr(StoreReader, "read_bytes", reading_header)
    return fetches


def test_each_source_file_is_fetched_in_one_request(tmp_path, monkeypatch):
    """Every tensor of every file is needed and the files are smaller than a window: one
    request per file (one per tensor before windows), and the output is exact."""
    spec = GPTSpec(num_layers=2, hidden=32, heads=4, query_groups=2, ffn=64, vocab=100,
                   optimizer="distributed_adam", bucket_numel=3000)
    tree, state, src = _store(tmp_path, spec, P(dp=2, tp=2), block=256)
    files = len(StoreReader(src).manifest.files)
    fetches = _count_fetches(monkeypatch)
    reshard(src, f"{tmp_path}/b", P(dp=1, tp=1, pp=2))
    assert len(fetches) == files and all(runs == 1 for _, runs in fetches), fetches
    assert_same_global(tree, state, load_global(f"{tmp_path}/b"))


def test_windows_read_no_tensor_that_no_target_needs(tmp_path):
    """One target file at a time, pp 1 -> 2: each group needs one stage's layers of every
    source file, whole tensors of 64 KiB and more apart: a window must not span the other
    stage's tensors. Reads stay within 5% of the bytes needed."""
    spec = GPTSpec(num_layers=4, hidden=128, heads=4, query_groups=4, ffn=512, vocab=256, optimizer="adam")
    tree, state, src = _store(tmp_path, spec, P(dp=1, tp=2), block=4096)
    report = reshard(src, f"{tmp_path}/b", P(dp=1, tp=2, pp=2), max_open_files=1)
    assert report.bytes_read <= 1.05 * report.bytes_needed, report
    assert_same_global(tree, state, load_global(f"{tmp_path}/b"))


@pytest.mark.parametrize("read_ahead", [1, 4096])
def test_small_windows_give_the_same_result(tmp_path, monkeypatch, read_ahead):
    spec = GPTSpec(num_layers=2, hidden=64, heads=4, query_groups=2, ffn=128, vocab=100,
                   optimizer="distributed_adam", bucket_numel=5000)
    tree, state, src = _store(tmp_path, spec, P(dp=2, tp=2), block=512)
    monkeypatch.setattr(execute, "READ_AHEAD", read_ahead)
    fetches = _count_fetches(monkeypatch)
    reshard(src, f"{tmp_path}/b", P(dp=1, tp=1, pp=2))
    assert len(fetches) > len(StoreReader(src).manifest.files)  # windows were cut
    assert_same_global(tree, state, load_global(f"{tmp_path}/b"))


def _reads(*spans):
    return [(0, i, SimpleNamespace(offset=offset, nbytes=n), None, None) for i, (offset, n) in enumerate(spans)]


def test_windows_end_at_a_gap_or_at_the_read_ahead_bound(monkeypatch):
    sizes = lambda windows: [[r[2].offset for r in w] for w in windows]  # noqa: E731
    # neighbours (a gap of MERGE_GAP is still one window), then a gap past MERGE_GAP
    reads = _reads((0, 100), (100 + MERGE_GAP, 100), (200 + 2 * MERGE_GAP + 1, 100))
    assert sizes(execute._windows(reads)) == [[0, 100 + MERGE_GAP], [200 + 2 * MERGE_GAP + 1]]
    monkeypatch.setattr(execute, "READ_AHEAD", 1000)
    # contiguous tensors: a window ends before it would pass READ_AHEAD bytes
    reads = _reads((0, 400), (400, 400), (800, 400), (1200, 400))
    assert sizes(execute._windows(reads)) == [[0, 400], [800, 1200]]
    # a tensor larger than READ_AHEAD is a window of its own
    assert sizes(execute._windows(_reads((0, 5000), (5000, 10)))) == [[0], [5000]]
