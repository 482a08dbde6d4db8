"""Optimizer state of real megatron-core MoE checkpoints (SequentialMLP, 4 experts, top-2, GQA + SwiGLU).

Two kinds the MoE round trips of ``formats/test_moe.py`` do not cover:

- the distributed optimizer saved ``dp_reshardable`` at ep 2 (``chained_0.``
  dense and ``chained_1.`` expert buffers) and with pp 2 / vpp 2 (one buffer
  per model chunk), resharded to other configs and kept ``dp_reshardable``;
- a non-distributed Adam (no ``--dist-opt``) at ep 2 -> 1 and 1 -> 2, legacy
  and ``torch_dist``.

Each case: megatron-core trains 2 steps, saves, and trains 2 more (the static
run). tenplex reshards; megatron-core at the target loads the result with
``strict=True`` (model) and the saved sharding type (optimizer), its logits
match the source's within 1e-6 (a fresh model's do not), and 2 more steps
match the static run within 1e-6.
"""

from pathlib import Path

import pytest
import torch

from inprocess_cli import tenplex
from mcore_checkpoint import megatron_load_dir
from moe_cases import FORMATS, check_resumed, source_cache

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

DP_RESHARDABLE = "--dist-opt --sharding-type dp_reshardable"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """``get(world, flags)``: a source trained and saved by megatron-core (see moe_cases)."""
    return source_cache(tmp_path_factory.mktemp("moe_optim"))


def dcp_keys(root) -> set[str]:
    """The DCP keys of a torch_dist checkpoint (a --save root: its tracker's iteration folder)."""
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(megatron_load_dir(str(root))).read_metadata().state_dict_metadata)


# (name, source world, source flags, target world, target flags, target config, target format)
DP_CASES = [
    ("ep2_to_ep1", 2, "--ep 2", 1, "--ep 1", "dp=1", "dist"),
    ("ep2_to_tp2ep2", 2, "--ep 2", 4, "--tp 2 --ep 2", "dp=2,tp=2,ep=2", "dist"),
    ("ep2_to_pp2vpp2ep2", 2, "--ep 2", 4, "--pp 2 --vpp 2 --ep 2", "dp=2,pp=2,vpp=2,ep=2", "dist"),
    ("pp2vpp2ep2_to_pp2vpp2", 4, "--pp 2 --vpp 2 --ep 2", 2, "--pp 2 --vpp 2", "dp=1,pp=2,vpp=2", "dist"),
    ("ep2_to_ep1_legacy", 2, "--ep 2", 1, "--ep 1", "dp=1", "legacy"),
]


@pytest.mark.parametrize("case", DP_CASES, ids=[c[0] for c in DP_CASES])
def test_dp_reshardable_with_experts_and_vpp_is_kept(sources, tmp_path, case):
    name, n_src, src, n_dst, dst, to, out_fmt = case
    source, static = sources(n_src, f"{src} {DP_RESHARDABLE}")
    keys = dcp_keys(source / "dist")
    assert any(k.startswith("chained_1.optimizer.distributed.") for k in keys)  # what megatron-core saved
    out = tmp_path / "out"
    done = tenplex("reshard", str(source / "dist"), str(out), "--to", to, "--format", FORMATS[out_fmt])
    assert done.returncode == 0, done.stderr
    if out_fmt == "dist":
        common = torch.load(Path(megatron_load_dir(str(out))) / "common.pt", weights_only=False)
        assert common["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
        keys = dcp_keys(out)
        assert not any(k.startswith("optimizer.state.") for k in keys)
        chained = "ep=2" in to
        assert any(k.startswith("chained_1.optimizer.distributed.dp_group_idx_") for k in keys) == chained
        assert any(".gbuf_idx_1." in k for k in keys) == ("vpp=2" in to)
    check_resumed(source, static, tmp_path, n_dst, f"{dst} {DP_RESHARDABLE}", out_fmt, out, "--strict", "on")


ADAM_CASES = [
    ("ep2_to_ep1", 2, "--ep 2", 1, "--ep 1", "dp=1", "legacy", "legacy"),
    ("ep2_to_ep1", 2, "--ep 2", 1, "--ep 1", "dp=1", "dist", "dist"),
    ("ep1_to_ep2", 2, "--ep 1", 2, "--ep 2", "dp=2,ep=2", "legacy", "legacy"),
    ("ep1_to_ep2", 2, "--ep 1", 2, "--ep 2", "dp=2,ep=2", "dist", "dist"),
    ("ep1_to_ep2", 2, "--ep 1", 2, "--ep 2", "dp=2,ep=2", "legacy", "dist"),
]


@pytest.mark.parametrize("case", ADAM_CASES, ids=[f"{c[0]}-{c[6]}-{c[7]}" for c in ADAM_CASES])
def test_non_distributed_adam_with_experts(sources, tmp_path, case):
    """Adam without the distributed optimizer: ``ChainedOptimizer`` of two ``FP32Optimizer`` s at ep > 1
    (legacy ``optimizer = [dense, expert]``; torch_dist moments and ``{0: dense, 1: expert}`` common)."""
    name, n_src, src, n_dst, dst, to, fmt, out_fmt = case
    source, static = sources(n_src, src + " --optimizer")
    out = tmp_path / "out"
    done = tenplex("reshard", str(source / fmt), str(out), "--to", to, "--format", FORMATS[out_fmt])
    assert done.returncode == 0, done.stderr
    if out_fmt == "dist":
        optimizer = torch.load(Path(megatron_load_dir(str(out))) / "common.pt", weights_only=False)["optimizer"]
        assert set(optimizer) == ({0, 1} if "ep=2" in to else {"state", "param_groups"}), optimizer.keys()
        assert not any(k.startswith("optimizer.state.param.") for k in dcp_keys(out))
    check_resumed(source, static, tmp_path, n_dst, dst + " --optimizer", out_fmt, out, "--strict", "on")


ETP_CASES = [
    # megatron-core's own legacy files at tp 2, ep 2, etp 1: mp_rank_00_000 and mp_rank_01_001 only
    ("tp2ep2etp1_to_ep2", 2, "--tp 2 --ep 2 --etp 1 --dist-opt", "legacy", 2, "--ep 2", "dp=2,ep=2"),
    ("ep2_dp_reshardable_to_tp2ep2etp1", 2, f"--ep 2 {DP_RESHARDABLE}", "dist", 2, "--tp 2 --ep 2 --etp 1",
     "dp=1,tp=2,ep=2,etp=1"),
]


@pytest.mark.parametrize("case", ETP_CASES, ids=[c[0] for c in ETP_CASES])
def test_legacy_moe_with_etp_below_tp(sources, tmp_path, case):
    """Legacy files with etp < tp where tp divides etp*ep are complete in Megatron-LM (each directory's
    writer has its readers' expert-tp rank): read and written, loaded by megatron-core; etp > tp is
    refused naming the rule."""
    name, n_src, src, fmt, n_dst, dst, to = case
    source, static = sources(n_src, src)
    out = tmp_path / "out"
    done = tenplex("reshard", str(source / fmt), str(out), "--to", to, "--format", "megatron-legacy")
    assert done.returncode == 0, done.stderr
    dirs = sorted(p.name for p in (out / "iter_0000010").iterdir())
    want = ["mp_rank_00_000", "mp_rank_01_001"] if "etp=1" in to else ["mp_rank_00_000", "mp_rank_00_001"]
    assert dirs == want
    check_resumed(source, static, tmp_path, n_dst, f"{dst} --dist-opt", "legacy", out, "--strict", "on")
    done = tenplex("reshard", str(source / fmt), str(tmp_path / "etp2"), "--to", "dp=4,tp=1,ep=2,etp=2",
                   "--format", "megatron-legacy")
    assert done.returncode == 1 and not (tmp_path / "etp2").exists()
    assert "ranks 0 and 1 (expert-tp ranks 0 and 1) share mp_rank_00_000" in done.stderr, done.stderr
    assert "only with etp == tp, or etp < tp with tp dividing etp*ep" in done.stderr
