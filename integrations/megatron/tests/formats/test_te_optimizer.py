"""Optimizer state of TransformerEngine models, kept by position, follows TE's parameter order.

Megatron-LM's defaults are ``--transformer-impl transformer_engine`` and, with the distributed
optimizer and ``torch_dist``, ``dp_reshardable`` state: flat buffers in reverse
``named_parameters()`` order. Under TE a layer's ``input_layernorm`` lives inside
``self_attention.linear_qkv`` (after ``linear_proj``), not first in the layer, so the buffers (and
``distrib_optim.pt``, and a legacy non-distributed Adam's param groups) hold it elsewhere than the
local spec's. A dense model's ``torch_dist`` keys are the same under both specs; the args'
``transformer_impl`` tells them apart.

The worker builds TE's layer structure on CPU (te_spec.py: megatron-core's own modules, the norm
fused in front of ``linear_qkv`` and ``linear_fc1`` with TE's parameter order). Each checkpoint is
resharded to another tp, pp and dp, megatron-core loads it in the same structure, and the next two
losses equal those of the run that saved it, going on uninterrupted.

Before (at af558d8): legacy sources were refused, and a ``dp_reshardable`` source was read in the
local spec's order: it resharded without a word and the next losses differed.
"""

import pytest

from inprocess_cli import tenplex
from mcore_helpers import losses, run_worker

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

FLAGS = ("--layers 4 --hidden 64 --heads 8 --query-groups 2 --ffn 96 --swiglu --position rope "
         "--untie --vocab 128 --make-vocab-size-divisible-by 16 --seq 8 --batch 4 --train-steps 2 --names te")


def _continues(src, dst, to, flags, expected, *, tp, pp, dp, load, out_fmt=None):
    """Reshard ``src`` to ``to`` (in ``out_fmt``, default the source's format), load it as ``load``
    at (``tp``, ``pp``, ``dp``) and check the next two losses."""
    done = tenplex("reshard", str(src), str(dst), "--to", to, *(["--format", f"megatron-{out_fmt}"] if out_fmt else []))
    assert done.returncode == 0, done.stderr
    got = losses(run_worker(tp, pp, flags, "--load", load, "--load-dir", str(dst), dp=dp))
    assert len(expected) == len(got) == 2
    for e, g in zip(expected, got):
        assert abs(e - g) <= 1e-6, (src, out_fmt, expected, got)


@pytest.fixture(scope="module")
def te_source(tmp_path_factory):
    """``(root, losses)``: a TE-structured model at tp 2 after two Adam steps (distributed optimizer,
    ``dp_reshardable``), saved in both formats, and the two losses of the run going on."""
    src = tmp_path_factory.mktemp("te")
    expected = losses(run_worker(2, 1, FLAGS + " --dist-opt", "--sharding-type", "dp_reshardable", "--save",
                                 "both", "--dist-layout", "megatron", "--save-dir", str(src),
                                 "--train-after-save", "2"))[2:]
    assert (src / "dist" / "latest_checkpointed_iteration.txt").exists()  # Megatron-LM's --save layout
    return src, expected


def test_distributed_optimizer_of_a_te_model_reshards(te_source, tmp_path):
    from tenplex_megatron.formats.dist.read import describe_dist

    src, expected = te_source
    meta = describe_dist(str(src / "dist")).desc.meta["megatron"]
    assert (meta["names"], meta["optimizer"]) == ("te", "dp_reshardable")  # told by the args
    cases = [("legacy", None), ("dist", None), ("dist", "legacy"), ("legacy", "dist")]
    for i, (fmt, out_fmt) in enumerate(cases):
        _continues(src / fmt, tmp_path / f"dst{i}", "dp=2,tp=1,pp=2", FLAGS + " --dist-opt", expected,
                   tp=1, pp=2, dp=2, load=out_fmt or fmt, out_fmt=out_fmt)


def test_a_wrong_parameter_order_is_refused(te_source, tmp_path):
    """Told the local spec (``--model-config``), the reader would place the buffers' state in the
    local order; the main params then differ from the weights and the source is refused, naming the
    first parameter whose state moved, before anything is written."""
    src, _ = te_source
    config = tmp_path / "local.json"
    config.write_text('{"transformer_impl": "local"}')
    done = tenplex("--model-config", str(config), "reshard", str(src / "dist"), str(tmp_path / "out"), "--to", "tp=1")
    assert done.returncode == 1, done.stderr
    assert "the fp32 main param of model/decoder/layers/0/input_layernorm/weight" in done.stderr \
        and "transformer_impl=local" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_non_distributed_adam_of_a_te_model_reshards(tmp_path):
    """A legacy non-distributed Adam keeps its state by index into the param groups, which follow
    ``named_parameters()`` too."""
    src = tmp_path / "src"
    expected = losses(run_worker(2, 1, FLAGS, "--save", "legacy", "--save-dir", str(src),
                                 "--train-after-save", "2"))[2:]
    _continues(src, tmp_path / "dst", "dp=1,tp=1,pp=2", FLAGS, expected, tp=1, pp=2, dp=1, load="legacy")
