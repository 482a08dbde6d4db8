"""megatron-core 0.19.2 (issue 19, failure 3): its own checkpoints reshard, and it loads the results.

0.19 writes no ``common.pt``: the args, the iteration and the rest of the common state are the DCP
byte item ``common_state/shard_0_1``, and ``metadata.json`` has no ``common_backend``. The test
installs megatron-core 0.19.2 in a virtual environment of its own (``--system-site-packages``, so
torch 2.13.0 and the CPU shim are shared; cached in the temp directory), as
docs/megatron.md says: ``pip install --no-deps --ignore-requires-python megatron-core==0.19.2`` and
``triton==3.7.1`` (0.19.2 imports triton without declaring it). Then 0.19.2's own save makes
legacy and torch_dist checkpoints of a dense GPT and of an MoE GPT (4 experts, ep 2, dp 2, saved as
Megatron-LM saves by default: ``--ckpt-fully-parallel-save``); tenplex (with
0.16.1 beside it, which it does not import) reshards them to both formats, and 0.19.2 loads every
output (tracker, then the iteration folder) with the source's logits within 2e-6.

On e4220c6 the first reshard (of the iteration folder) fails: ``common.pt has no args; pass the model
config``. A TransformerEngine-structured model with the distributed optimizer (Megatron-LM's defaults)
continues training after a reshard; on af558d8 (before TE's parameter order) its next losses were
4.82, 4.82 instead of 4.36, 4.21.
"""

import subprocess

import pytest
import torch

import mcore_venv
from mcore_helpers import TESTS, logits, losses, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

VERSION = "0.19.2"
DENSE = ("--layers 2 --hidden 64 --heads 4 --ffn 128 --position learned_absolute --vocab 100 "
         "--make-vocab-size-divisible-by 16 --seq 8")
MOE = ("--layers 2 --hidden 64 --heads 4 --query-groups 2 --ffn 96 --swiglu --position rope --untie "
       "--vocab 128 --make-vocab-size-divisible-by 16 --seq 8 --batch 4 --experts 4 --topk 2")


def venv_python() -> str:
    return mcore_venv.venv_python(VERSION)


def run(python: str, worker: str, n: int, flags: str, *extra: str) -> str:
    return torchrun(TESTS / worker, n, [*flags.split(), *extra], timeout=400, python=python)


def tenplex(*args: str) -> None:
    done = subprocess.run(["tenplex", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    python = venv_python()
    d = tmp_path_factory.mktemp("mcore019")
    run(python, "mcore_worker.py", 2, DENSE, "--tp", "2", "--save", "both", "--dist-layout", "megatron",
        "--save-dir", str(d / "dense"), "--logits-out", str(d / "dense.pt"))
    run(python, "moe_worker.py", 2, MOE, "--ep", "2", "--save", "both", "--save-dir", str(d / "moe"),
        "--logits-out", str(d / "moe.pt"), "--fully-parallel-save")  # Megatron-LM's default, at dp 2
    dist = d / "dense" / "dist" / "iter_0000010"
    assert not (dist / "common.pt").exists() and not (d / "moe" / "dist" / "common.pt").exists()
    assert "common_backend" not in (dist / "metadata.json").read_text()  # 0.19's own form
    return python, d


def test_019_checkpoints_reshard_and_load_in_019(saved, tmp_path):
    python, d = saved
    cases = [  # (source, target format, --to, worker, world, flags at the target, load as, logits)
        (d / "dense" / "dist" / "iter_0000010", "megatron-dist", "tp=1", "mcore_worker.py", 1, DENSE, "dist",
         "dense"),  # the iteration folder itself
        (d / "dense" / "dist", "megatron-legacy", "tp=1", "mcore_worker.py", 1, DENSE, "legacy", "dense"),
        (d / "dense" / "legacy", "megatron-dist", "tp=1,pp=2", "mcore_worker.py", 1, DENSE, "dist", "dense"),
        (d / "moe" / "dist", "megatron-dist", "dp=1", "moe_worker.py", 1, MOE, "dist", "moe"),
        (d / "moe" / "dist", "megatron-legacy", "dp=1", "moe_worker.py", 1, MOE, "legacy", "moe"),
        (d / "moe" / "legacy", "megatron-legacy", "dp=1", "moe_worker.py", 1, MOE, "legacy", "moe"),
    ]
    for i, (src, fmt, to, worker, n, flags, load_as, ref) in enumerate(cases):
        out = tmp_path / f"out{i}"
        tenplex("reshard", str(src), str(out), "--to", to, "--format", fmt)
        got = tmp_path / f"got{i}.pt"
        if worker == "mcore_worker.py":
            run(python, worker, n, flags, "--seed", "7", "--also-load", load_as, str(out),
                str(tmp_path / f"fresh{i}.pt"), str(got))
        else:
            run(python, worker, n, flags, "--seed", "7", "--load", load_as, "--load-dir", str(out),
                "--loaded-logits-out", str(got), "--fresh-logits-out", str(tmp_path / f"fresh{i}.pt"))
        want = logits(d / f"{ref}.pt")
        assert (logits(got) - want).abs().max().item() <= 2e-6, cases[i]
        assert (logits(tmp_path / f"fresh{i}.pt") - want).abs().max().item() > 1e-3, cases[i]


def test_019_sources_shared_under_torchrun_read_as_opened(saved):
    """0.19's torch_dist keeps its common state in a DCP byte item, not ``common.pt``: a source that
    process 0 shares as JSON (``share``, as under torchrun) must rebuild from it, reading nothing
    but tensor bytes, with every rank's stored tensors and every value the opened source's."""
    import json

    from count_reads import counting
    from tenplex.transform.agree import tree_digest
    from tenplex_megatron.formats.plugin import DIST, LEGACY

    _, d = saved
    for model in ("dense", "moe"):
        for kind, fmt in (("legacy", LEGACY), ("dist", DIST)):
            root = str(d / model / kind)
            source = fmt.open_source(root)
            shared = json.loads(json.dumps(fmt.share(source), allow_nan=False))
            with counting(root) as opened:
                back = fmt.open_shared(root, shared)
            assert opened.bytes == 0 and opened.opens == 0 and opened.uncounted == 0, (model, kind)
            assert tree_digest(back.tree) == tree_digest(source.tree) and back.config == source.config
            assert back.desc.values == source.desc.values and back.meta == source.meta, (model, kind)
            config = source.config
            for path, _ in source.tree.tensors():
                for r in range(config.world_size):
                    if source.sharding.holding(path, config.coord(r)) is None:
                        continue
                    a, b = source.read(source.record(path, r)), back.read(back.record(path, r))
                    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), \
                        (model, kind, path, r)
            for path, _ in source.tree.values():
                for key in source.desc.values[path] if path == "megatron/rng_state" else [""]:
                    assert back.value(path, key) == source.value(path, key), (model, kind, path, key)


TE = ("--layers 4 --hidden 64 --heads 8 --query-groups 2 --ffn 96 --swiglu --position rope --untie --vocab 128 "
      "--make-vocab-size-divisible-by 16 --seq 8 --batch 4 --train-steps 2 --names te --dist-opt")


def test_019_te_model_distributed_optimizer_continues(tmp_path):
    """Megatron-LM's defaults under 0.19.2: TransformerEngine's layer structure (te_spec.py builds it from
    0.19's own modules, whose MLP spec is a ``functools.partial``) and the distributed optimizer's
    ``dp_reshardable`` buffers, kept in TE's parameter order. Saved at tp 2 after two Adam steps,
    resharded to dp 2, tp 1, pp 2; 0.19.2's next two losses equal the uninterrupted run's (a wrong
    order is refused by the main-param check, or trains on swapped moments)."""
    python = venv_python()
    src = tmp_path / "src"
    expected = losses(run(python, "mcore_worker.py", 2, TE, "--tp", "2", "--sharding-type", "dp_reshardable",
                          "--save", "dist", "--dist-layout", "megatron", "--save-dir", str(src),
                          "--train-after-save", "2"))[2:]
    tenplex("reshard", str(src), str(tmp_path / "out"), "--to", "dp=2,tp=1,pp=2")  # the --save root
    got = losses(run(python, "mcore_worker.py", 4, TE, "--tp", "1", "--pp", "2", "--load", "dist",
                     "--load-dir", str(tmp_path / "out")))
    assert len(expected) == len(got) == 2 and all(abs(e - g) <= 1e-6 for e, g in zip(expected, got)), \
        (expected, got)
