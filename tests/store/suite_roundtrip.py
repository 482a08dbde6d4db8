"""Round trips through a store: reads that start and end in the middle of checksum blocks.

The suite saves a 14 MB GPT state whose largest tensors are 2 MB, with
checksum blocks of 64 B to 4 KiB (and a block size that is no power of
two), so that every range read starts and ends mid-block and most stored
tensors start mid-block too.
"""

from __future__ import annotations

import pytest

from tenplex.api import load_global, reshard, save, verify
from tenplex.ptree import ParallelConfig as P
from tenplex.store import StoreReader
from tenplex.store.execute import StorePlanRunner
from tenplex.transform import make_plan

from .fixtures import StoreFixtures
from .helpers import SRC, assert_rank_loads, assert_same_global

TARGETS = ["dp=1,tp=4,pp=1", "dp=2,tp=1,pp=2", "dp=1,tp=1,pp=1"]


class RoundTripSuite(StoreFixtures):
    """save / load / load_global / reshard, bit-exact, on one backend."""

    @pytest.mark.parametrize("block", [64, 1000, 4096])
    def test_save_load_global_round_trip(self, root, state, block):
        tree, st, shards = state
        save(f"{root}/ck", tree, SRC, shards, block=block)
        got = load_global(f"{root}/ck")
        assert_same_global(tree, st, got)
        assert got["optimizer/step"] == st["optimizer/step"]
        assert got["rng/tensor_parallel"] == st["rng/tensor_parallel"]
        assert verify(f"{root}/ck", progress=False).tensors > 0

    @pytest.mark.parametrize("target,block", [(TARGETS[0], 96), (TARGETS[1], 4096),
                                              (TARGETS[2], 1000)])
    def test_every_rank_loads_bit_exact(self, root, state, target, block):
        """Each rank of the target reads only its regions: runs that start and end mid-block."""
        tree, st, shards = state
        save(f"{root}/ck", tree, SRC, shards, block=block)
        assert_rank_loads(f"{root}/ck", tree, st, P.parse(target))

    @pytest.mark.parametrize("target", TARGETS)
    def test_reshard_round_trip(self, root, state, target):
        tree, st, shards = state
        save(f"{root}/a", tree, SRC, shards, block=4096)
        report = reshard(f"{root}/a", f"{root}/b", P.parse(target), block=1000)
        assert_same_global(tree, st, load_global(f"{root}/b"))
        assert_rank_loads(f"{root}/b", tree, st, P.parse(target))
        assert_rank_loads(f"{root}/b", tree, st, SRC, values=False)  # and back: partial reads
        verify(f"{root}/b", progress=False)
        assert report.bytes_needed <= report.bytes_read

    def test_load_one_rank_reads_only_its_ranges(self, root, state):
        tree, st, shards = state
        save(f"{root}/ck", tree, SRC, shards, block=4096)
        reader = StoreReader(f"{root}/ck")
        total = sum(f.size for f in reader.manifest.files.values())
        target = P(dp=1, tp=2, pp=2)
        runner = StorePlanRunner(reader, make_plan(tree, SRC, target))
        try:
            for path, _ in tree.tensors():
                runner.leaf(path, [3])
        finally:
            runner.close()
        # one stage's tp half: range reads fetch far less than the whole checkpoint
        assert reader.bytes_read < 0.5 * total
        assert runner.bytes_needed <= reader.bytes_read
