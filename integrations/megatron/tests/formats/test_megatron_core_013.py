"""megatron-core 0.13.1's ``torch_dist`` checkpoints with the distributed optimizer: resharded, and trained on.

Megatron-LM before core 0.14 saved the distributed optimizer's state as
``fully_sharded_model_space`` by default (``--ckpt-fully-parallel-save``; 0.14 and 0.15 still do
with ``--dist-ckpt-save-pre-mcore-014``, which slime and miles set): each parameter's tp shard
flattened and cut by dp rank, under ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>``
(formats/dist/model_space.py), with megatron-core's ``MCoreSavePlan`` records in ``.metadata`` and
the per-parameter Adam ``step`` of torch's Adam left in ``common.pt``. 0.16.1 cannot write this
form ("ShardedTensor.flattened_range is not supported"), so the test installs megatron-core 0.13.1
in a virtual environment of its own (mcore_venv.py) and lets it train and save at tp 2, dp 2.

tenplex reshards it to legacy files, which 0.13.1 loads and trains on, and to ``torch_dist``
(``fully_reshardable``, which 0.13 does not read), which 0.16.1 loads and trains on: the next two
losses equal those of the run that went on. On c65add9 every such checkpoint was refused
(``MCoreSavePlan is not in the DCP metadata allow-list``; past that, "optimizer sharding type
'fully_sharded_model_space' is not supported").
"""

import subprocess
import sys

import pytest
import torch

import mcore_venv
from mcore_helpers import TESTS, losses, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

MODEL = ("--layers 2 --hidden 64 --heads 4 --query-groups 2 --ffn 96 --swiglu --position rope --vocab 128 "
         "--make-vocab-size-divisible-by 16 --seq 8 --batch 4 --dist-opt")


MOE = ("--layers 4 --hidden 64 --heads 4 --query-groups 2 --ffn 96 --swiglu --position rope --untie "
       "--vocab 128 --make-vocab-size-divisible-by 16 --seq 8 --batch 4 --experts 4 --topk 2 --dist-opt")


def run(python: str, n: int, *extra: str, worker: str = "mcore_worker.py", model: str = MODEL) -> str:
    return torchrun(TESTS / worker, n, [*model.split(), *extra], timeout=400, python=python)


def reshard(src, dst, to: str, fmt: str) -> None:
    done = subprocess.run(["tenplex", "reshard", str(src), str(dst), "--to", to, "--format", fmt],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


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
    _, root, _ = saved
    folder = root / "iter_0000010"
    common = torch.load(folder / "common.pt", weights_only=False)  # the test's own file, written just now
    assert common["optimizer"]["param_state_sharding_type"] == "fully_sharded_model_space"
    assert b"MCoreSavePlan" in (folder / ".metadata").read_bytes()
    from tenplex_megatron.formats.dist.read import describe_dist

    found = describe_dist(str(root))
    assert found.desc.meta["megatron"]["optimizer"] == "fully_sharded_model_space"
    shapes = {k: tuple(v.size) for k, v in found.md.state_dict_metadata.items() if hasattr(v, "size")}
    # fc1 at tp 2: gate and up shards of each tp rank, 4 rows of 48 x 64 elements, per layer
    assert shapes["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"] == (2, 4, 1, 48 * 64)


@pytest.mark.parametrize("fmt,to,n,flags,python", [
    ("megatron-legacy", "dp=1,tp=1,pp=2", 2, ("--tp", "1", "--pp", "2"), "0.13.1"),
    ("megatron-dist", "dp=2,tp=1", 2, ("--tp", "1"), "0.16.1"),
], ids=["legacy_in_013", "dist_in_016"])
def test_013_checkpoint_reshards_and_trains_on(saved, tmp_path, fmt, to, n, flags, python):
    venv, root, expected = saved
    reshard(root, tmp_path / "out", to, fmt)
    load = "legacy" if fmt == "megatron-legacy" else "dist"
    got = losses(run(venv if python == "0.13.1" else sys.executable, n, *flags, "--load", load,
                     "--load-dir", str(tmp_path / "out"), "--train-steps", "2"))
    assert len(expected) == len(got) == 2 and all(abs(e - g) <= 1e-6 for e, g in zip(expected, got)), \
        (expected, got)


def test_013_moe_checkpoint_with_chained_keys_reshards_and_trains_on(saved, tmp_path):
    """At ep 2 megatron-core 0.13 chains a dense and an expert optimizer and puts ``chained_0.`` and
    ``chained_1.`` before their keys (0.14 added ``chained_optim_avoid_prefix``); the experts' items
    have the leading (layer, expert) axes. Resharded to ep 1 (legacy, in 0.13.1) and kept at ep 2
    (``torch_dist``, in 0.16.1), training goes on with the losses of the run that saved it."""
    venv, _, _ = saved
    src = tmp_path / "src"
    out = run(venv, 2, "--ep", "2", "--train-steps", "2", "--sharding-type", "fully_sharded_model_space",
              "--save", "dist", "--save-dir", str(src), "--train-after-save", "2", worker="moe_worker.py",
              model=MOE)
    expected = losses(out)[2:]
    assert b"chained_1.optimizer.state.exp_avg.decoder.layers.mlp.experts" in (src / ".metadata").read_bytes()
    for fmt, to, n, ep, python in (("megatron-legacy", "dp=1", 1, "1", venv),
                                   ("megatron-dist", "dp=2,ep=2", 2, "2", sys.executable)):
        dst = tmp_path / fmt
        reshard(src, dst, to, fmt)
        got = losses(run(python, n, "--ep", ep, "--load", fmt.removeprefix("megatron-"), "--load-dir", str(dst),
                         "--train-steps", "2", worker="moe_worker.py", model=MOE))
        assert len(expected) == len(got) == 2 and all(abs(e - g) <= 1e-6 for e, g in zip(expected, got)), \
            (fmt, expected, got)
