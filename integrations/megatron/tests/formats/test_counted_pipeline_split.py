"""Pipelines that count the embedding as a layer (``--account-for-embedding-in-pipeline-split``).

megatron-core then builds one decoder layer less on the first stage: 3 layers at pp 2 are (1, 2),
not an even split. On 30f0678 tenplex ignored the flag and refused every such checkpoint
("pp=2 does not divide num_layers=3"). Saved by megatron-core after 2 steps with the distributed
optimizer (both formats; ``dp_reshardable`` keeps each stage's buffers by position, so the split
decides every offset), resharded to pp 1 (legacy) and to pp 3 (torch_dist), loaded by
megatron-core, and trained on with the source run's next two losses.
"""

import pytest

from inprocess_cli import tenplex
from mcore_helpers import losses, run_worker

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

FLAGS = ("--layers 3 --hidden 64 --heads 8 --query-groups 2 --ffn 96 --swiglu --position rope --untie "
         "--vocab 128 --make-vocab-size-divisible-by 16 --seq 8 --batch 4 --train-steps 2 --dist-opt")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("counted")
    out = run_worker(1, 2, FLAGS, "--account-for", "embedding", "--sharding-type", "dp_reshardable",
                     "--save", "both", "--save-dir", str(d), "--train-after-save", "2")
    got = losses(out)
    assert len(got) == 4, out
    return d, got[2:]


@pytest.mark.parametrize("fmt,pp", [("legacy", 1), ("dist", 3)])
def test_the_counted_split_reshards_and_training_goes_on(source, tmp_path, fmt, pp):
    src, expected = source
    done = tenplex("reshard", str(src / fmt), str(tmp_path / "out"), "--to", f"pp={pp}")
    assert done.returncode == 0, done.stderr
    got = losses(run_worker(1, pp, FLAGS, "--load", fmt, "--load-dir", str(tmp_path / "out")))
    assert len(got) == 2 and max(abs(a - b) for a, b in zip(got, expected)) <= 1e-6, (got, expected)
