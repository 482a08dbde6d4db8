"""A torchrun worker for live/test_snapshots.py: the megatron-core job of live_snapshots.py, run by
two torchrun agents as two hosts (``TENPLEX_SNAPSHOT_DIR`` per agent).

First attempt (``TORCHELASTIC_RESTART_COUNT`` 0): ``live_snapshots.run_old`` at world size 4, then
wait until OUT/host-lost exists (the test has killed host B), then a barrier that fails, so that
torchrun restarts this host's workers. Restarted attempt: ``live_snapshots.run_new`` at world size 2.
"""

import datetime
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import torch
    import torch.distributed as dist
    from tenplex_megatron import cpu_shim

    out = sys.argv[1]
    cpu_shim.apply_optimizer_patches()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    import live_snapshots as ls
    import live_workers as w

    rank = dist.get_rank()
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        ls.run_old(rank, out, None)            # this agent's TENPLEX_SNAPSHOT_DIR
        open(os.path.join(out, f"ready-{rank}"), "w").close()
        while not os.path.exists(os.path.join(out, "host-lost")):
            time.sleep(0.2)
        dist.barrier()                         # fails: host B is gone
        raise RuntimeError("the barrier should have failed: no host was lost")
    try:
        ls.run_new(rank, out, None)
    except BaseException:
        w.write(out, f"error-restarted-{rank}", traceback.format_exc())
        raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
