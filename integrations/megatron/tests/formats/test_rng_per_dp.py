"""RNG states kept per dp-cp rank: what megatron-core 0.16's Megatron-LM saves with experts.

Megatron-LM core_v0.16.0 and 0.16.1 save each dp-cp rank's RNG state apart when ep > 1
(``rng_state/shard_<pp>.<tp>.<dp>_<PP>.<TP>.<DP>``, Megatron-LM #2658: ranks of one dp group hold
different expert-parallel streams) and load only that form at ep > 1; 0.17.0 went back to the
(pp, tp) grid (#3736), which 0.15 and 0.19 save and load. tenplex on 30f0678 refused every such
checkpoint ("unknown key rng_state/shard_0.0.0_1.1.2").

The source is saved by megatron-core 0.16.1 at ep 2, dp 2 (the worker's ``rng_object`` is
Megatron-LM's ``get_rng_state`` of that version). Each case reshards it; megatron-core loads the
output with its RNG states, restores them (a draw from every tracker stream), prints each
rank's digest, and trains on with the static run's losses.
"""

import os
import re
import subprocess
import sys

import pytest

from inprocess_cli import tenplex
from mcore_checkpoint import rng_digest
from mcore_helpers import losses, torchrun
from mcore_venv import venv_python
from moe_cases import MODEL, WORKER, run_moe
from tenplex_megatron.model.rng import derive

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

FLAGS = "--ep 2 --dist-opt"


def rng_by_rank(output: str) -> dict[tuple[int, int, int], str]:
    """``{(tp, pp, dp): digest}`` from the worker's ``RNG tp=T pp=P dp=D <digest>`` records."""
    found = re.findall(r"RNG tp=(\d+) pp=(\d+) dp=(\d+) ([0-9a-f]{16})", output)
    return {(int(t), int(p), int(d)): digest for t, p, d, digest in found}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """megatron-core 0.16.1 at ep 2, dp 2, saved after 2 steps with its RNG states, then 2 more steps."""
    d = tmp_path_factory.mktemp("rng")
    out = run_moe(2, FLAGS, "--train-steps", "2", "--save", "dist", "--save-dir", str(d / "dist"), "--save-rng",
                  "--fully-parallel-save", "--logits-out", str(d / "ref.pt"), "--train-after-save", "2")
    saved = rng_by_rank(out)
    assert set(saved) == {(0, 0, 0), (0, 0, 1)} and saved[(0, 0, 0)] != saved[(0, 0, 1)], out
    assert b"rng_state/shard_0.0.1_1.1.2" in (d / "dist" / ".metadata").read_bytes()
    return d, saved, losses(out)


def _reshard(src, out, to: str) -> str:
    done = tenplex("reshard", str(src), str(out), "--to", to, "--format", "megatron-dist")
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_more_dp_ranks_keep_the_saved_states_and_derive_the_new_ones(source, tmp_path):
    """ep 2, dp 2 -> dp 4: dp-cp ranks 0 and 1 restore their own saved states, 2 and 3 a state derived
    from the seed as megatron-core seeds a fresh run (noted; the expert stream by each rank's ep rank,
    2 % 2 and 3 % 2), and 0.16.1 loads the output (it asks for the (pp, tp, dp) objects)."""
    d, saved, static = source
    out = tmp_path / "out"
    stderr = _reshard(d / "dist", out, "dp=4,ep=2")
    assert "rng: tp=0,pp=0 held 2 dp states, the target needs 4; missing ones derived" in stderr
    got = run_moe(4, FLAGS, "--load", "dist", "--load-dir", str(out), "--load-rng", "--train-steps", "2")
    loaded = rng_by_rank(got)
    derived = [rng_digest(derive(1234, 0, 0, kind="cpu", ep_rank=ep)) for ep in (0, 1)]
    assert loaded == {(0, 0, 0): saved[(0, 0, 0)], (0, 0, 1): saved[(0, 0, 1)],
                      (0, 0, 2): derived[0], (0, 0, 3): derived[1]}, got
    assert len(losses(got)) == 2, got
    assert max(abs(a - b) for a, b in zip(losses(got), static[2:])) <= 1e-6, (losses(got), static)


def _rng_objects(root) -> dict[str, bytes]:
    """``{key: the object's bytes}`` of the RNG objects of a torch_dist output."""
    from tenplex_megatron.dcp.safe import read_checked
    from tenplex_megatron.dcp.records import MetadataIndex

    folder = next(root.glob("iter_*"))
    md = read_checked(str(folder))[0]
    out = {}
    for key in md.state_dict_metadata:
        if key.startswith("rng_state/"):
            info = md.storage_data[MetadataIndex(key)]
            with open(folder / info.relative_path, "rb") as f:
                f.seek(info.offset)
                out[key] = f.read(info.length)
    return out


def test_every_writer_writes_the_same_objects(source, tmp_path):
    """The direct item copy, the planner through a tenplex store (values as JSON) and 2 processes
    under torchrun (the shared source) write the same RNG objects: both grids, 5 in all."""
    d = source[0]
    _reshard(d / "dist", tmp_path / "direct", "dp=4,ep=2")
    done = tenplex("reshard", str(d / "dist"), str(tmp_path / "store"), "--to", "dp=2,ep=2")
    assert done.returncode == 0, done.stderr
    _reshard(tmp_path / "store", tmp_path / "planned", "dp=4,ep=2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "tenplex",
           "reshard", str(d / "dist"), str(tmp_path / "torchrun"), "--to", "dp=4,ep=2", "--format", "megatron-dist"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    direct = _rng_objects(tmp_path / "direct")
    assert sorted(direct) == ["rng_state/shard_0.0.0_1.1.4", "rng_state/shard_0.0.1_1.1.4",
                              "rng_state/shard_0.0.2_1.1.4", "rng_state/shard_0.0.3_1.1.4", "rng_state/shard_0.0_1.1"]
    assert _rng_objects(tmp_path / "planned") == direct
    assert _rng_objects(tmp_path / "torchrun") == direct


def test_without_experts_every_rank_restores_dp_rank_0s_state(source, tmp_path):
    """ep 2 -> ep 1: the (pp, tp) grid only; every dp rank restores dp-cp rank 0's state, as
    Megatron-LM saves and loads it without experts; the dropped state is noted."""
    d, saved, static = source
    out = tmp_path / "out"
    stderr = _reshard(d / "dist", out, "dp=2,ep=1")
    assert "rng: tp=0,pp=0 held 2 dp states, the target needs 1; extra ones dropped" in stderr
    got = run_moe(2, "--ep 1 --dist-opt", "--load", "dist", "--load-dir", str(out), "--load-rng",
                  "--train-steps", "2")
    assert rng_by_rank(got) == {(0, 0, 0): saved[(0, 0, 0)], (0, 0, 1): saved[(0, 0, 0)]}, got
    assert max(abs(a - b) for a, b in zip(losses(got), static[2:])) <= 1e-6, (losses(got), static)


def test_megatron_core_019_loads_the_same_output_by_its_own_grid(source, tmp_path):
    """At ep > 1 tenplex writes both forms: megatron-core 0.19.2 (its own venv) asks for the (pp, tp)
    object, restores dp-cp rank 0's state on both ranks, and ignores the per-rank objects."""
    d, saved, _ = source
    out = tmp_path / "out"
    _reshard(d / "dist", out, "dp=2,ep=2")
    got = torchrun(WORKER, 2, [*FLAGS.split(), *MODEL.split(), "--load", "dist", "--load-dir", str(out),
                               "--load-rng"], python=venv_python("0.19.2"))
    assert rng_by_rank(got) == {(0, 0, 0): saved[(0, 0, 0)], (0, 0, 1): saved[(0, 0, 0)]}, got


def test_growing_to_experts_writes_the_grid_that_0_16_loads(tmp_path):
    """A 0.16.1 save without experts (the (pp, tp) grid) resharded to ep 2: 0.16.1 at ep 2 asks for
    the per-rank objects (on 30f0678 only the (pp, tp) one was written, and the load failed); dp-cp
    rank 0 restores the saved state, rank 1 one derived with its expert stream (ep rank 1)."""
    d = tmp_path / "src"
    out = run_moe(2, "--ep 1 --dist-opt", "--train-steps", "2", "--save", "dist", "--save-dir", str(d / "dist"),
                  "--save-rng", "--fully-parallel-save", "--logits-out", str(d / "ref.pt"), "--train-after-save", "2")
    saved, static = rng_by_rank(out), losses(out)
    assert set(saved) == {(0, 0, 0)} and b"rng_state/shard_0.0_1.1" in (d / "dist" / ".metadata").read_bytes()
    stderr = _reshard(d / "dist", tmp_path / "out", "dp=2,ep=2")
    assert "rng: tp=0,pp=0 held 1 dp states, the target needs 2; missing ones derived" in stderr
    got = run_moe(2, FLAGS, "--load", "dist", "--load-dir", str(tmp_path / "out"), "--load-rng", "--train-steps", "2")
    assert rng_by_rank(got) == {(0, 0, 0): saved[(0, 0, 0)],
                                (0, 0, 1): rng_digest(derive(1234, 0, 0, kind="cpu", ep_rank=1))}, got
    assert max(abs(a - b) for a, b in zip(losses(got), static[2:])) <= 1e-6, (losses(got), static)


def test_legacy_files_keep_each_ep_ranks_state(tmp_path):
    """Legacy files at ep 2 are written by one rank per ep rank, each with its own state (their expert
    streams differ). Resharded to dp 4, every rank restores the state of its own ep rank's file (on
    30f0678 every file got dp-cp rank 0's); to torch_dist, ranks 0 and 1 keep theirs and ranks 2 and 3
    (new) are derived."""
    d = tmp_path / "src"
    out = run_moe(2, FLAGS, "--train-steps", "2", "--save", "legacy", "--save-dir", str(d / "legacy"),
                  "--train-after-save", "2")
    saved, static = rng_by_rank(out), losses(out)
    assert set(saved) == {(0, 0, 0), (0, 0, 1)} and saved[(0, 0, 0)] != saved[(0, 0, 1)], out
    done = tenplex("reshard", str(d / "legacy"), str(tmp_path / "legacy"), "--to", "dp=4,ep=2")
    assert done.returncode == 0, done.stderr
    got = run_moe(4, FLAGS, "--load", "legacy", "--load-dir", str(tmp_path / "legacy"), "--load-rng",
                  "--train-steps", "2")
    assert rng_by_rank(got) == {(0, 0, r): saved[(0, 0, r % 2)] for r in range(4)}, got
    assert max(abs(a - b) for a, b in zip(losses(got), static[2:])) <= 1e-6, (losses(got), static)
    _reshard(d / "legacy", tmp_path / "dist", "dp=4,ep=2")
    got = run_moe(4, FLAGS, "--load", "dist", "--load-dir", str(tmp_path / "dist"), "--load-rng")
    derived = [rng_digest(derive(1234, 0, 0, kind="cpu", ep_rank=ep)) for ep in (0, 1)]
    assert rng_by_rank(got) == {(0, 0, 0): saved[(0, 0, 0)], (0, 0, 1): saved[(0, 0, 1)],
                                (0, 0, 2): derived[0], (0, 0, 3): derived[1]}, got
