"""reshard keeps at most ``max_open_files`` target files open, whatever the target's world size."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tenplex.api import load_global, reshard, save
from tenplex.formats.conformance import count_open_store_files
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize

from .helpers import assert_same_global

SPEC = GPTSpec(num_layers=2, hidden=32, heads=4, query_groups=2, ffn=64, vocab=100,
               optimizer="distributed_adam", bucket_numel=3000)
A = P(dp=2, tp=2)
WIDE = P(dp=128, tp=1)  # the dp-sharded optimizer state gives each of the 128 ranks its own file


def _source(root):
    tree = gpt_tree(SPEC)
    state = random_state(tree, A, 1)
    save(f"{root}/a", tree, A, {r: materialize(tree, state, A, r) for r in range(A.world_size)})
    return tree, state


def test_reshard_holds_at_most_max_open_files(tmp_path, monkeypatch):
    tree, state = _source(tmp_path)
    peak = count_open_store_files(monkeypatch)
    reshard(f"{tmp_path}/a", f"{tmp_path}/b", WIDE, max_open_files=5)
    assert 1 < peak[0] <= 5
    assert len(list((tmp_path / "b" / "shards").iterdir())) == 128
    assert_same_global(tree, state, load_global(f"{tmp_path}/b"))


def test_reshard_to_many_ranks_under_a_low_open_file_limit(tmp_path):
    """128 target files under RLIMIT_NOFILE=100: one open file per target rank fails (EMFILE)."""
    _source(tmp_path)
    script = textwrap.dedent(f"""
        import resource
        from tenplex.api import reshard
        from tenplex.ptree import ParallelConfig as P
        resource.setrlimit(resource.RLIMIT_NOFILE, (100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        reshard({str(tmp_path / "a")!r}, {str(tmp_path / "b")!r}, P(dp=128, tp=1))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list((tmp_path / "b" / "shards").iterdir())) == 128


def _open_shards() -> int:
    """Descriptors of this process open on a shard file."""
    import os
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "/shards/rank-" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return count


def test_a_reader_opens_each_local_shard_file_once_and_keeps_few_open(tmp_path, monkeypatch):
    """Reads keep local shard files open (opening and path-checking one per read cost 86 us),
    at most ``OPEN_FILES`` of them, least recently used out first."""
    import pytest

    import tenplex.store.reader as reader_module
    from tenplex.store.reader import StoreReader
    if not __import__("os").path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    from tenplex.store.writer import save as save_store
    tree = gpt_tree(SPEC)
    state = random_state(tree, A, 1)
    save_store(f"{tmp_path}/a", tree, A, {r: materialize(tree, state, A, r) for r in range(A.world_size)},
               block=1 << 12)  # several fetches per file
    reader = StoreReader(f"{tmp_path}/a")
    opened, open_read = [], reader.root.open_read
    monkeypatch.setattr(reader.root, "open_read", lambda key, what=None: opened.append(key) or open_read(key, what))
    recs = sorted(reader.manifest.tensors.values(), key=lambda r: (r.offset, r.file))  # the files in turn
    files = {r.file for r in recs}
    assert len(files) >= 4
    for rec in recs:
        reader.read(rec)
    assert sorted(opened) == sorted(files)  # once each
    reader.close()
    assert _open_shards() == 0
    monkeypatch.setattr(reader_module, "OPEN_FILES", 2)
    reader, peak = StoreReader(f"{tmp_path}/a"), 0
    for rec in recs:
        reader.read(rec)
        peak = max(peak, _open_shards())
    assert peak == 2
    reader.close()
