"""``memory_budget`` bounds the memory a live transfer takes, even for a region 16x the budget.

Two gloo processes move a 64 MiB strided region with a 4 MiB budget. The
executor's own accounting (``report.peak_buffer``) must stay within the
budget, and, independently, each process's resident-set high-water mark
must not grow past what it held before plus its new shard plus the budget
and a slack for the allocator and the runtime. Staging the region whole at
either end (what the executor did before) would add 64 MiB.
"""

import json
import multiprocessing as mp

import pytest

from tests.helpers import budget_workers as bw


pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
BUDGET = 4 << 20
SLACK = 8 << 20           # allocator, thread stacks, gloo (nothing beyond the budget measured here)
REGION = 64 << 20


def test_peak_memory_of_a_transfer_stays_within_the_budget(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=bw.budget_worker, args=(r, BUDGET, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert not p.is_alive() and p.exitcode == 0
    results = [json.loads((tmp_path / f"budget-{r}.json").read_text()) for r in range(2)]
    for r, got in enumerate(results):
        assert got["exact"], f"process {r}: the new shard differs"
        assert got["new_shard"] == REGION
        assert BUDGET // 2 <= got["peak_buffer"] <= BUDGET, got       # the executor's accounting
        assert got["rounds"] >= REGION // BUDGET, got
        assert got["extra"] <= BUDGET + SLACK, (r, got)                  # the kernel's count (RSS)
