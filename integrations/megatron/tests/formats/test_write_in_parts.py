"""The protocol's write in parts for Megatron targets (issue 25), in one process: parts, then one commit.

The parts ``torchrun ... tenplex reshard`` writes on several processes are
written here one after another from a real megatron-core checkpoint; the
commit must refuse a part's file that is short or missing (nothing visible,
no tracker), and otherwise give the single-process output byte for byte.
"""

import pytest

from tenplex.api import verify
from tenplex.errors import CorruptShardError
from tenplex.formats import Part, detect, get_format
from tenplex.ptree.config import ParallelConfig

from tenplex_megatron.formats.folders import TRACKER

pytestmark = pytest.mark.slow  # the megatron-core checkpoints (shared with the other tests) take a while

TO = ParallelConfig.parse("dp=1,tp=1,pp=4")


def _files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _parts(fmt, source, dst, token: str, n: int = 3) -> list[dict]:
    return [fmt.write(source, str(dst), TO, part=Part(i, n, token), threads=2).part for i in range(n)]


@pytest.mark.parametrize("target", ["megatron-legacy", "megatron-dist"])
def test_parts_commit_once_to_the_single_process_output_and_a_bad_part_commits_nothing(sources, tmp_path,
                                                                                       target):
    src = sources("mha", 2, 2) / "dist"
    single, dst = tmp_path / "single", tmp_path / "dst"
    fmt = get_format(target)
    source = detect(str(src)).open_source(str(src))
    fmt.write(source, str(single), TO, threads=2)  # the planner's path (reshard would copy dist items directly)

    parts = _parts(fmt, source, dst, "run1")
    assert not (dst / TRACKER).exists() and not list(dst.glob("iter_*"))  # written, not visible
    assert sorted(f for p in parts for f in p["files"]) == sorted(parts[0]["expected"])
    victim = next(f for p in parts for f in p["files"] if f.endswith((".pt", ".distcp")))
    path = next(dst.glob(".iter_*.tmp-run1")) / victim
    path.write_bytes(path.read_bytes()[:-1])  # a file one byte short of what its part reported
    with pytest.raises(CorruptShardError, match=f"{victim}: expected .* bytes as its part reported"):
        fmt.commit(str(dst), TO, parts, part=Part(0, 3, "run1"))
    with pytest.raises(CorruptShardError, match="missing"):  # a part that never reported
        fmt.commit(str(dst), TO, parts[:2], part=Part(0, 3, "run1"))
    assert not (dst / TRACKER).exists() and not list(dst.glob("iter_*"))
    fmt.abort(str(dst), part=Part(0, 3, "run1"), everything=True)
    assert list(dst.iterdir()) == []

    parts = _parts(fmt, source, dst, "run2")
    done = fmt.commit(str(dst), TO, parts, part=Part(0, 3, "run2"))
    assert done.files == len(parts[0]["expected"])
    verify(str(dst))
    one, many = _files(single), _files(dst)
    assert one.keys() == many.keys()
    assert all(one[k] == many[k] for k in one if not k.endswith(".metadata")), \
        [k for k in one if one[k] != many[k]]
