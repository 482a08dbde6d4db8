"""Store reads during recovery run beside the transfers, not before them (issue 10).

A replacement process reads its lost tp shards from the store and receives the replicated leaves
from a survivor. Each of its store reads waits until one of its receive rounds has landed: that
can only happen when the reads run on their own threads while the rounds go on. Reads run one
after another before the first round would each wait out ``overlap_workers.WAIT`` and report it.
"""

import json
import multiprocessing as mp

import pytest

from tests.helpers import overlap_workers as ow
from tenplex.api import save
from tenplex.ptree import materialize

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_store_reads_wait_for_a_round_and_recovery_is_exact(tmp_path):
    truth = ow.state()
    url = str(tmp_path / "ck")
    save(url, ow.TREE, ow.CONFIG, {r: materialize(ow.TREE, truth, ow.CONFIG, r) for r in range(2)})
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=ow.worker, args=(r, str(tmp_path / "rendezvous"), url, str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        if p.is_alive():
            p.kill()
    results = [json.loads((tmp_path / f"overlap-{r}.json").read_text()) for r in range(2)]
    assert all("error" not in r for r in results), results
    survivor, replacement = results
    assert survivor["exact"] and replacement["exact"], results
    assert survivor["reads"] == 0 and replacement["reads"] > 0 and replacement["received"], results
    assert replacement["all_waited_for_a_round"], results    # no read ran before a round had landed
    assert replacement["store"] > 0 and replacement["sent"] > 0, results   # totals over both processes
