"""megatron-core 0.13.1's ``torch_dist`` checkpoints with the distributed optimizer: resharded, and trained on.

Megatron-LM before core 0.14 saved the distributed optimizer's state as
``fully_sharded_model_space`` by default (``--ckpt-fully-parallel-save``; 0.14 and 0.15 still do
with ``--dist-ckpt-save-pre-mcore-014``, which slime and miles set): each parameter's tp shard
flattened and cut by dp rank, under ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>``
(formats/dist/model_space.py), with megatron-core's ``MCoreSavePlan`` records in ``.metadata`` and
the per-parameter Adam ``step`` of torch's Adam left in ``common.pt``. 0.16.1 cannot write this
form ("ShardedTensor.flattened_range is not supported"), so the test installs megatron-core 0.13.1
in a virtual environment of its own (mcore_venv.py) and lets it train and save at tp 2, dp 2.

tenplex reshards it to legacy files, which 0.13.1 loads and trains on; an MoE model's (ep 2, chained
optimizer keys) goes to ``torch_dist`` (``fully_reshardable``, which 0.13 does not read), which 0.16.1
loads and trains on: the next two losses equal those of the run that went on. On c65add9 every such checkpoint was refused
(``MCoreSavePlan is not in the DCP metadata allow-list``; past that, "optimizer sharding type
'fully_sharded_model_space' is not supported").
"""

import sys

import pytest
import torch

import mcore_venv
from inprocess_cli import tenplex
from mcore_helpers import TESTS, losses, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

MODEL = ("--layers 2 --hidden 64 --heads 4 --query-groups 2 --ffn 96 --swiglu --position rope --vocab 128 "
         "--make-vocab-size-divisible-by 16 --seq 8 --batch 4 --dist-opt")


MOE = ("--layers 4 --hidden 64 --heads 4 --query-groups 2 --ffn 96 --swiglu --position rope --untie "
       "--vocab 128 --make-vocab-size-divisible-by 16 --seq 8 --batch 4 --experts 4 --topk 2 --dist-opt")


def run(python: str, n: int, *extra: str, worker: str = "mcore_worker.py", model: str = MODEL) -> str:
    return torchrun(TESTS / worker, n, [*model.split(), *extra], timeout=400, python=python)


def reshard(src, dst, to: str, fmt: str) -> str:
    done = tenplex("reshard", str(src), str(dst), "--to", to, "--format", fmt)
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(python 0.13.1, root, the losses of the run going on)``: tp 2, dp 2, two Adam steps, saved as
    Megatron-LM 0.13 saves by default."""
    python = mcore_venv.venv_python("0.13.1")
    root = tmp_path_factory.mktemp("mcore013") / "src"
    out = run(python, 4, "--tp", "2", "--train-steps", "2", "--sharding-type", "fully_sharded_model_space",
              "--save", "dist", "--dist-layout", "megatron", "--save-dir", str(root), "--train-after-save", "2")
    return python, root, losses(out)[2:]


def test_013_model_space_optimizer_state_is_read_as_saved(saved):
    python, root, _ = saved
    folder = root / "iter_0000010"
    common = torch.load(folder / "common.pt", weights_only=False)  # the test's own file, written just now
    assert common["optimizer"]["param_state_sharding_type"] == "fully_sharded_model_space"
    from tenplex_megatron.dcp.safe import DCP_GLOBALS

    named = mcore_venv.globals_named(python, folder / ".metadata")
    assert ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan") in named
    assert named <= set(DCP_GLOBALS)  # the allow-list holds every global 0.13.1 names
    from tenplex_megatron.formats.dist.read import describe_dist

    found = describe_dist(str(root))
    assert found.desc.meta["megatron"]["optimizer"] == "fully_sharded_model_space"
    shapes = {k: tuple(v.size) for k, v in found.md.state_dict_metadata.items() if hasattr(v, "size")}
    # fc1 at tp 2: gate and up shards of each tp rank, 4 rows of 48 x 64 elements, per layer
    assert shapes["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"] == (2, 4, 1, 48 * 64)


def test_013_checkpoint_reshards_to_legacy_files_and_0_13_trains_on(saved, tmp_path):
    """tp 2, dp 2 to tp 1, pp 2 (every tp shard of the state read and joined; SwiGLU's halves apart)."""
    venv, root, expected = saved
    reshard(root, tmp_path / "out", "dp=1,tp=1,pp=2", "megatron-legacy")
    got = losses(run(venv, 2, "--tp", "1", "--pp", "2", "--load", "legacy", "--load-dir", str(tmp_path / "out"),
                     "--train-steps", "2"))
    assert len(expected) == len(got) == 2 and all(abs(e - g) <= 1e-6 for e, g in zip(expected, got)), \
        (expected, got)


def test_013_moe_checkpoint_with_chained_keys_reshards_and_trains_on(saved, tmp_path):
    """At ep 2 megatron-core 0.13 chains a dense and an expert optimizer and puts ``chained_0.`` and
    ``chained_1.`` before their keys (0.14 added ``chained_optim_avoid_prefix``); the experts' items
    have the leading (layer, expert) axes. Written as ``torch_dist`` (``fully_reshardable``, which
    0.13 cannot read), megatron-core 0.16.1 goes on training with the losses of the run that saved it."""
    venv, _, _ = saved
    src = tmp_path / "src"
    out = run(venv, 2, "--ep", "2", "--train-steps", "2", "--sharding-type", "fully_sharded_model_space",
              "--save", "dist", "--save-dir", str(src), "--train-after-save", "2", worker="moe_worker.py",
              model=MOE)
    expected = losses(out)[2:]
    assert b"chained_1.optimizer.state.exp_avg.decoder.layers.mlp.experts" in (src / ".metadata").read_bytes()
    reshard(src, tmp_path / "out", "dp=2,ep=2", "megatron-dist")
    got = losses(run(sys.executable, 2, "--ep", "2", "--load", "dist", "--load-dir", str(tmp_path / "out"),
                     "--train-steps", "2", worker="moe_worker.py", model=MOE))
    assert len(expected) == len(got) == 2 and all(abs(e - g) <= 1e-6 for e, g in zip(expected, got)), \
        (expected, got)


def test_013_dp_zero_state_reshards_and_trains_on(saved, tmp_path):
    """``--no-ckpt-fully-parallel-save`` before 0.14: each (tp, pp) rank's flat buffers gathered into one
    byte object (formats/dist/dp_zero.py), ``dp_group_idx = t + tp * p``. Saved at tp 2, pp 2, resharded
    to tp 1, pp 1 as ``torch_dist``; megatron-core 0.16.1 goes on with the losses of the run that saved it.
    (On c65add9: "optimizer sharding type 'dp_zero_gather_scatter' is not supported".)"""
    venv, _, _ = saved
    src = tmp_path / "src"
    out = run(venv, 4, "--tp", "2", "--pp", "2", "--train-steps", "2", "--sharding-type", "dp_zero_gather_scatter",
              "--save", "dist", "--save-dir", str(src), "--train-after-save", "2")
    expected = losses(out)[2:]
    assert b"dp_group_idx_3.param_state" in (src / ".metadata").read_bytes()
    _shared_reads_as_opened(src)
    said = reshard(src, tmp_path / "out", "dp=1,tp=1,pp=1", "megatron-dist")
    assert "written fully_reshardable, which megatron-core 0.14 and later load" in said  # 0.13 cannot
    got = losses(run(sys.executable, 1, "--tp", "1", "--load", "dist", "--load-dir", str(tmp_path / "out"),
                     "--train-steps", "2"))
    assert len(expected) == len(got) == 2 and all(abs(e - g) <= 1e-6 for e, g in zip(expected, got)), \
        (expected, got)


def _shared_reads_as_opened(root) -> None:
    """Under torchrun process 0 sends the opened source as JSON: rebuilt from it, every optimizer leaf
    reads the bytes the opened source reads."""
    import json

    from tenplex_megatron.formats.plugin import DIST

    source = DIST.open_source(str(root))
    back = DIST.open_shared(str(root), json.loads(json.dumps(DIST.share(source), allow_nan=False)))
    config = source.config
    for path, _ in source.tree.tensors():
        if path.startswith("optimizer/"):
            for r in range(config.world_size):
                if source.sharding.holding(path, config.coord(r)) is not None:
                    a, b = source.read(source.record(path, r)), back.read(back.record(path, r))
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (path, r)
