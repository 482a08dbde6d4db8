"""Real megatron-core MoE checkpoints (SequentialMLP, 4 experts, top-2, GQA + SwiGLU) resharded by the CLI.

Each case: megatron-core trains 2 steps with the distributed optimizer, saves,
and trains 2 more (the static run). tenplex reshards the checkpoint; megatron-core
at the target loads it with ``strict=True``, its logits match the source's
within 1e-6 (a fresh model's do not), and 2 more steps match the static run
within 1e-6 (training continuity).
"""

import pytest
import torch

from inprocess_cli import tenplex
from mcore_helpers import logits
from moe_cases import FORMATS, check_resumed, run_moe, source_cache

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

DIST_OPT = " --dist-opt"


# (name, source world, source flags, target world, target flags, target config)
CASES = [
    ("ep2_to_ep1", 2, "--ep 2", 1, "--ep 1", "dp=1"),
    ("tp2ep1_to_tp1ep2", 2, "--tp 2 --ep 1", 2, "--tp 1 --ep 2", "dp=2,ep=2"),
    ("pp2vpp2_to_pp1", 2, "--pp 2 --vpp 2", 1, "", "dp=1"),
    ("pp1_to_pp2vpp2", 1, "", 2, "--pp 2 --vpp 2", "dp=1,pp=2,vpp=2"),
    ("cp2_to_dp2", 2, "--cp 2", 2, "", "dp=2"),
    # world 2, tp 1, ep 2: dense dp 2, expert dp 1 (megatron-core's expert grid ETP x EP x EDP x PP)
    ("ep1_to_ep2", 1, "", 2, "--ep 2", "dp=2,ep=2"),
]


@pytest.fixture(scope="module")
def moe_sources(tmp_path_factory):
    """``get(world, flags)``: a source trained and saved with the distributed optimizer (see moe_cases)."""
    get = source_cache(tmp_path_factory.mktemp("moe"))
    return lambda n, flags: get(n, flags + DIST_OPT)


# every case within each format (torch_dist -> torch_dist is the direct item copy), and the ep
# changes across formats (through the planner and both writers)
PARAMS = [(c, f, f) for c in CASES for f in FORMATS] + \
    [(CASES[0], "dist", "legacy"), (CASES[1], "legacy", "dist")]


@pytest.mark.parametrize("case,fmt,out_fmt", PARAMS, ids=[f"{c[0]}-{a}-{b}" for c, a, b in PARAMS])
def test_moe_reshard_loads_and_trains_on(moe_sources, tmp_path, case, fmt, out_fmt):
    name, n_src, src, n_dst, dst, to = case
    source, static = moe_sources(n_src, src)
    out = tmp_path / "out"
    done = tenplex("reshard", str(source / fmt), str(out), "--to", to, "--format", FORMATS[out_fmt])
    assert done.returncode == 0, done.stderr
    check_resumed(source, static, tmp_path, n_dst, dst + DIST_OPT, out_fmt, out)

def test_impossible_expert_targets_are_refused_in_one_line(moe_sources, tmp_path):
    source, _ = moe_sources(2, "--ep 2")
    done = tenplex("reshard", str(source / "legacy"), str(tmp_path / "ep3"), "--to", "dp=3,ep=3")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].endswith("ep=3 does not divide num_moe_experts=4 "
                                                         "(model/decoder/layers/0/mlp/experts/0/linear_fc1/weight)")
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "ep3").exists()
    done = tenplex("reshard", str(source / "legacy"), str(tmp_path / "etp"), "--to", "dp=4,tp=1,ep=2,etp=2")
    assert done.returncode == 1 and "share mp_rank_00_000: their expert shards collide" in done.stderr, done.stderr
    assert not (tmp_path / "etp").exists()


def _to_grouped(root, mixed: bool = False) -> None:
    """Rename a legacy checkpoint's SequentialMLP keys to TE grouped-GEMM names in place
    (``local_experts.{j}.linear_fc1.weight`` -> ``linear_fc1.weight{j}``; one extra state per
    grouped linear). ``mixed`` leaves expert 0 of layer 0 under its sequential name."""
    import re

    for path in root.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        model = {}
        for key, value in state["model"].items():
            m = re.fullmatch(r"(decoder\.layers\.\d+\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc\d)\.(weight|_extra_state)", key)
            if m is None or (mixed and key.startswith("decoder.layers.0.mlp.experts.local_experts.0.")):
                model[key] = value
            elif m.group(4) == "weight":
                model[f"{m.group(1)}.{m.group(3)}.weight{m.group(2)}"] = value
            else:
                model[f"{m.group(1)}.{m.group(3)}._extra_state"] = None
        state["model"] = model
        torch.save(state, path)


def test_grouped_gemm_names_are_read_kept_and_converted(moe_sources, tmp_path):
    """Expert ids under grouped-GEMM names map local -> global like sequential ones; the output keeps
    the source's scheme unless asked; a file mixing both schemes is refused."""
    import shutil
    from tenplex.ptree.config import ParallelConfig
    from tenplex_megatron.formats.legacy.read import open_legacy
    from tenplex_megatron.formats.legacy.write import write_legacy

    source, _ = moe_sources(2, "--ep 2")
    grouped = tmp_path / "grouped"
    shutil.copytree(source / "legacy", grouped)
    _to_grouped(grouped)
    done = tenplex("reshard", str(grouped), str(tmp_path / "kept"), "--to", "dp=1")
    assert done.returncode == 0, done.stderr
    keys = torch.load(tmp_path / "kept/iter_0000010/mp_rank_00/model_optim_rng.pt", weights_only=False)["model"]
    assert "decoder.layers.3.mlp.experts.linear_fc2.weight3" in keys
    assert not any("local_experts" in k for k in keys)
    # global expert 3 is ep rank 1's local expert 1
    src = torch.load(grouped / "iter_0000010/mp_rank_00_001/model_optim_rng.pt", weights_only=False)["model"]
    assert torch.equal(keys["decoder.layers.3.mlp.experts.linear_fc2.weight3"],
                       src["decoder.layers.3.mlp.experts.linear_fc2.weight1"])
    write_legacy(open_legacy(str(grouped)), str(tmp_path / "sequential"), ParallelConfig(), expert_names="sequential")
    run_moe(1, "--ep 1" + DIST_OPT, "--load", "legacy", "--load-dir", str(tmp_path / "sequential"),
            "--loaded-logits-out", str(tmp_path / "got.pt"))
    assert (logits(source / "ref.pt") - logits(tmp_path / "got.pt")).abs().max().item() <= 1e-6
    mixed = tmp_path / "mixed"
    shutil.copytree(source / "legacy", mixed)
    _to_grouped(mixed, mixed=True)
    done = tenplex("reshard", str(mixed), str(tmp_path / "no"), "--to", "dp=1")
    assert done.returncode == 1 and "mix the sequential" in done.stderr, done.stderr
    assert not (tmp_path / "no").exists()
