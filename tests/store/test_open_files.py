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
