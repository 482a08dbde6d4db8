"""megatron-core 0.15.2's ``torch_dist`` checkpoints: read, resharded, and trained on in 0.15.2.

0.15 pickles every ``.metadata`` root as its own ``MCoreMetadata`` (a DCP ``Metadata`` with an
``mcore_data`` field), and its save plans as ``MCoreSavePlan``; tenplex reads both through its
allow-list as the plain records (tenplex_megatron/dcp/safe.py). The test installs 0.15.2 in a
virtual environment of its own (mcore_venv.py), saves at tp 2 after two Adam steps (distributed
optimizer, ``fully_reshardable``), reshards to tp 1 and lets 0.15.2 train on: the next two losses
equal those of the run that went on. On f3d6c0e (before) every 0.15 checkpoint was refused:
"global megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata is not in the DCP metadata
allow-list".
"""

import pytest

import mcore_venv
from inprocess_cli import tenplex
from mcore_helpers import TESTS, losses, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

MODEL = ("--layers 2 --hidden 64 --heads 4 --query-groups 2 --ffn 96 --swiglu --position rope --vocab 128 "
         "--make-vocab-size-divisible-by 16 --seq 8 --batch 4 --dist-opt --sharding-type fully_reshardable")


def test_015_checkpoint_reshards_and_trains_on(tmp_path):
    from tenplex_megatron.dcp.safe import DCP_GLOBALS

    python = mcore_venv.venv_python("0.15.2")
    src = tmp_path / "src"
    out = torchrun(TESTS / "mcore_worker.py", 2, [*MODEL.split(), "--tp", "2", "--train-steps", "2", "--save", "dist",
                                                  "--save-dir", str(src), "--train-after-save", "2"], python=python)
    expected = losses(out)[2:]
    named = mcore_venv.globals_named(python, src / ".metadata")
    assert ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata") in named
    assert named <= set(DCP_GLOBALS)
    done = tenplex("reshard", str(src), str(tmp_path / "out"), "--to", "tp=1")
    assert done.returncode == 0, done.stderr
    got = losses(torchrun(TESTS / "mcore_worker.py", 1, [*MODEL.split(), "--tp", "1", "--load", "dist", "--load-dir",
                                                         str(tmp_path / "out"), "--train-steps", "2"], python=python))
    assert len(expected) == len(got) == 2 and all(abs(e - g) <= 1e-6 for e, g in zip(expected, got)), \
        (expected, got)
