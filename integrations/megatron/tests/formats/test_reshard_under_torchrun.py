"""``tenplex reshard`` of real megatron-core checkpoints under torchrun (issue 25).

The legacy and torch_dist checkpoints of one megatron-core run (tp=2, pp=2,
tied embeddings) are resharded to a tenplex store at tp=1, pp=4 by four
processes (torchrun --standalone, gloo); the result verifies and equals the
single-process reshard tensor for tensor, bit for bit.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tenplex.api import load_global, reshard, verify
from tenplex.ptree.config import ParallelConfig

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

DST = "dp=1,tp=1,pp=4"


def _torchrun(nproc: int, args: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--monitor-interval=0.5", "-m", "tenplex", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_four_processes_reshard_a_megatron_checkpoint_as_one_process_does(sources, tmp_path, fmt):
    src = sources("mha", 2, 2) / fmt
    single, dst = tmp_path / "single", tmp_path / "dst"
    one = reshard(str(src), str(single), ParallelConfig.parse(DST), format="tenplex", threads=2)
    report = _torchrun(4, ["reshard", str(src), str(dst), "--to", DST, "--format", "tenplex", "--json",
                           "--threads", "2"])
    verify(str(dst))
    a, b = load_global(str(dst)), load_global(str(single))
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype and v.shape == b[k].shape, k
            assert torch.equal(v.reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k
        else:
            assert v == b[k], k
    assert sorted(r for p in report["processes"] for r in p["ranks"]) == [0, 1, 2, 3]
    print(json.dumps({"format": fmt, "bytes_read": report["bytes_read"], "single_needed": one.bytes_needed,
                      "single_read": one.bytes_read,
                      "per_process": [p["bytes_read"] for p in report["processes"]]}))
