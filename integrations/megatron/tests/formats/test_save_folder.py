"""Megatron-LM's ``--save`` folder (issue 19, failure 1): ``ROOT/latest_checkpointed_iteration.txt`` and
``ROOT/iter_NNNNNNN/``, for legacy and torch_dist, read and written.

megatron-core 0.16.1 saves a trained GPT (tp 2, distributed optimizer) in both formats under
Megatron-LM's layout at iteration 7. tenplex reshards the roots and the iteration folders to
both formats; every output is a ``--save`` root whose tracker names iteration 7. One
megatron-core job at tp 1 then loads each output as Megatron-LM's ``load_checkpoint`` does
(tracker, then the iteration folder; ``mcore_checkpoint.megatron_load_dir``), model and
optimizer, and reproduces the source's logits within 2e-6 and its Adam moments by global
parameter name, bit for bit; a torch_dist output written for
pp 2 is loaded at pp 1 through megatron-core's own resharding.

On e4220c6 the first reshard fails: ``iter_0000007: no mp_rank_* directories`` (the torch_dist
root was taken for a legacy checkpoint), and a torch_dist output had no tracker.
"""

import pathlib

import pytest
import torch

from mcore_checkpoint import TRACKER, megatron_load_dir
from inprocess_cli import tenplex
from mcore_helpers import MODELS, logits, run_worker

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

ITER = "iter_0000007"
LEGACY, DIST = "megatron-legacy", "megatron-dist"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> pathlib.Path:
    """megatron-core's checkpoints in Megatron-LM's --save layout: ``legacy/`` and ``dist/`` roots."""
    d = tmp_path_factory.mktemp("save_folder")
    run_worker(2, 1, MODELS["mha"], "--train-steps", "1", "--dist-opt", "--iteration", "7",
               "--save", "both", "--dist-layout", "megatron", "--save-dir", str(d),
               "--logits-out", str(d / "ref.pt"))
    for fmt in ("legacy", "dist"):
        assert (d / fmt / TRACKER).read_text().strip() == "7"
        assert (d / fmt / ITER).is_dir()
    return d


def _reshard(src, dst, to, fmt) -> None:
    done = tenplex("reshard", str(src), str(dst), "--to", to, "--format", fmt)
    assert done.returncode == 0, done.stderr


def _check_root(out: pathlib.Path, fmt: str) -> None:
    assert (out / TRACKER).read_text().strip() == "7"
    assert sorted(p.name for p in out.iterdir()) == sorted([TRACKER, ITER])
    if fmt == DIST:
        common = torch.load(out / ITER / "common.pt", weights_only=False)
        assert common["iteration"] == 7 and common["args"].tensor_model_parallel_size == 1
    else:
        state = torch.load(out / ITER / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
        assert state["iteration"] == 7


def test_save_roots_and_iteration_folders_reshard_and_load_in_megatron(saved, tmp_path):
    cases = [  # (source, target format, --to, loaded at tp 1 pp 1 as)
        (saved / "dist", DIST, "tp=1", "dist"),            # torch_dist root: direct dist -> dist
        (saved / "dist", LEGACY, "tp=1", "legacy"),        # torch_dist root -> legacy root
        (saved / "dist" / ITER, DIST, "tp=1,pp=2", "dist"),  # iteration folder; loaded at pp 1 by megatron-core
        (saved / "legacy", DIST, "tp=1", "dist"),          # legacy root -> torch_dist root
        (saved / "legacy" / ITER, LEGACY, "tp=1", "legacy"),  # legacy iteration folder
    ]
    loads = []
    for i, (src, fmt, to, load_as) in enumerate(cases):
        out = tmp_path / f"out{i}"
        _reshard(src, out, to, fmt)
        _check_root(out, fmt)
        loads += ["--also-load", load_as, str(out), str(tmp_path / f"fresh{i}.pt"), str(tmp_path / f"got{i}.pt")]
    run_worker(1, 1, MODELS["mha"], "--optimizer", "--dist-opt", *loads, "--also-load-optim-dir", str(tmp_path))
    ref = logits(saved / "ref.pt")
    want = _source_adam(saved / "legacy")
    for i, case in enumerate(cases):
        got, fresh = logits(tmp_path / f"got{i}.pt"), logits(tmp_path / f"fresh{i}.pt")
        assert (got - ref).abs().max().item() <= 2e-6, case
        assert (fresh - ref).abs().max().item() > 1e-3, case  # the load did something
        loaded = torch.load(tmp_path / f"optim{i}.pt")
        assert {(n, k) for n in loaded for k in loaded[n]} == set(want), case
        for (name, state), tensor in want.items():  # logical rows: megatron-core pads the vocabulary
            assert torch.equal(loaded[name][state][: tensor.shape[0]], tensor), (case, name, state)


def _source_adam(root: pathlib.Path) -> dict:
    """``{(global parameter name, "exp_avg" | "exp_avg_sq"): global tensor}`` of the source, as tenplex
    reads it (logical rows)."""
    from tenplex.formats.conformance import global_tensors
    from tenplex_megatron.formats.plugin import LEGACY as LEGACY_FORMAT

    out = {}
    for path, tensor in global_tensors(LEGACY_FORMAT.open_source(str(root))).items():
        kind, _, rest = path.partition("/")
        state, _, name = rest.partition("/")
        if kind == "optimizer" and state in ("exp_avg", "exp_avg_sq"):
            out[(name.replace("/", "."), state)] = tensor
    assert out, "the source holds no Adam state"
    return out


def test_iteration_picks_a_folder_and_a_missing_one_is_named(saved, tmp_path):
    from tenplex.errors import ManifestError
    from tenplex_megatron.formats.plugin import DIST as DIST_FORMAT, LEGACY as LEGACY_FORMAT

    assert DIST_FORMAT.detect(str(saved / "dist")) and not LEGACY_FORMAT.detect(str(saved / "dist"))
    assert LEGACY_FORMAT.detect(str(saved / "legacy")) and not DIST_FORMAT.detect(str(saved / "legacy"))
    assert DIST_FORMAT.describe(str(saved / "dist"), iteration=7).values["megatron/iteration"] == 7
    with pytest.raises(ManifestError, match="iter_0000003: the iteration folder asked for is missing"):
        DIST_FORMAT.describe(str(saved / "dist"), iteration=3)
    with pytest.raises(ManifestError, match="iter_0000003: the iteration folder asked for is missing"):
        LEGACY_FORMAT.describe(str(saved / "legacy"), iteration="3")
    assert megatron_load_dir(str(saved / "dist")).endswith(ITER)
