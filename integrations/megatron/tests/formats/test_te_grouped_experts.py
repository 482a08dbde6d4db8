"""Grouped-GEMM experts under TransformerEngine (``TEGroupedMLP``) with the distributed optimizer.

Megatron-LM's usual MoE run is ``--transformer-impl transformer_engine --moe-grouped-gemm
--use-distributed-optimizer``. Its optimizer state is kept by position (``distrib_optim.pt``, and
``dp_reshardable`` buffers in ``torch_dist``), in reverse ``named_parameters()`` order, where
``TEGroupedMLP`` puts every local expert's ``linear_fc1`` before every ``linear_fc2``.

The worker builds megatron-core's ``TEGroupedMLP`` on CPU over a stand-in for TE's
``GroupedLinear`` (te_spec.py: one parameter per local expert, ``weight{i}``, in TE's order),
trains 2 steps at ep 2, saves Megatron-LM legacy files (the stand-in has no sharded state dict,
so no ``torch_dist``) and trains 2 more. tenplex reshards the files; megatron-core at the target
loads them: logits within 1e-6 of the source's and the next 2 losses within 1e-6 of the run that
went on.

Before (at bc7e02a) tenplex refused such a checkpoint ("has not checked TEGroupedMLP's parameter
order"); read in ``SequentialMLP`` order, the main-param check refuses it (the last test).
"""

import pytest

from inprocess_cli import tenplex
from moe_cases import check_resumed, source_cache

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

FLAGS = " --grouped-gemm --names te --dist-opt"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """``(root, static losses)``: ep 2, world 2, saved legacy after 2 steps."""
    root = tmp_path_factory.mktemp("te_grouped")
    get = source_cache(root, save="legacy")
    return get(2, "--ep 2" + FLAGS)


@pytest.mark.parametrize("to,n,flags", [("dp=1", 1, "--ep 1"), ("dp=1,tp=2", 2, "--tp 2 --ep 1")],
                         ids=["ep2_to_ep1", "ep2_to_tp2"])
def test_te_grouped_experts_reshard_and_train_on(source, tmp_path, to, n, flags):
    root, static = source
    out = tmp_path / "out"
    done = tenplex("reshard", str(root), str(out), "--to", to)
    assert done.returncode == 0, done.stderr
    check_resumed(root, static, tmp_path, n, flags + FLAGS, "legacy", out)


def test_sequential_order_is_refused_by_the_main_param_check(source, tmp_path):
    """Told the experts are ``SequentialMLP`` ones, the reader places their state elsewhere: refused."""
    root, _ = source
    config = tmp_path / "sequential.json"
    config.write_text('{"moe_grouped_gemm": false}')
    done = tenplex("--model-config", str(config), "reshard", str(root), str(tmp_path / "no"),
                   "--to", "dp=1")
    assert done.returncode == 1
    assert "the fp32 main param of model/decoder/layers/0/mlp/experts/" in done.stderr, done.stderr
    assert not (tmp_path / "no").exists()
