"""The runnable examples in examples/ run as documented."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent


@pytest.mark.slow
@pytest.mark.multiprocess
def test_elastic_torchrun_example():
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=4", str(ROOT / "examples" / "elastic_torchrun.py")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "live dp=2,tp=2,pp=1 -> dp=1,tp=4,pp=1" in done.stdout
    assert "rank 0 loaded its shards at dp=2,tp=1,pp=2" in done.stdout
    assert "recovered lost rank 1 with renumbered survivors" in done.stdout
    assert "0 read from the store; 30 steps kept" in done.stdout
