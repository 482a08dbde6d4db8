"""Live renumbering: the new ranks go to the processes that keep the most bytes in place."""

import json
import multiprocessing as mp
import time

import pytest

from tenplex.transform import make_plan
from tenplex.transform.assign import placement_bound

from tests.helpers import elastic_workers as w
from tests.helpers import renumber_workers as rw
from tests.helpers.rendezvous import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
CTX = mp.get_context("spawn")


@pytest.mark.parametrize("whole_up_to", ["0", "8"], ids=["parts", "whole"])
def test_renumbered_change_moves_only_the_placement_bound_and_is_bit_exact(tmp_path, monkeypatch, whole_up_to):
    monkeypatch.setenv("TENPLEX_WHOLE_PLAN_UP_TO", whole_up_to)  # each process plans its part, or the whole
    port = free_port()
    procs = [CTX.Process(target=rw.renumber, args=(r, port, str(tmp_path))) for r in range(4)]
    for p in procs:
        p.start()
    deadline = time.time() + 180
    for p in procs:
        p.join(max(1, deadline - time.time()))
        if p.is_alive():
            p.kill()
            pytest.fail("a worker hung past the timeout")
    errors = [e.read_text() for e in tmp_path.glob("error-*.json")]
    assert [p.exitcode for p in procs] == [0, 0, 0, 0], errors
    got = [json.loads((tmp_path / f"renumber-{r}.json").read_text()) for r in range(4)]
    given, renumbered = got[0]["given"], got[0]["renumbered"]
    # the given (contiguous) numbering: new rank 1 (stage 1) sits on process 1, which holds
    # stage 0, so it receives all it needs but the tied embedding (held on both stages); the
    # whole plan says the same
    contiguous = make_plan(w.TREE, rw.SRC, rw.DST)
    assert given["dst_of"] == [0, 1, None, None]
    assert given["sent"] == given["planned_moved"] == contiguous.totals.moved
    tied = "model/embedding/word_embeddings/weight"  # and its optimizer state
    need_1 = sum(op.nbytes for op in contiguous.ops if op.dst_rank == 1 and tied not in op.path)
    moved_1 = sum(op.nbytes for op in contiguous.ops
                  if op.dst_rank == 1 and op.src_rank not in (1, -1) and tied not in op.path)
    assert moved_1 == need_1 > 0
    # renumbered: stage 1 goes to a process that holds stage 1; only the bound moves
    bound = placement_bound(w.TREE, rw.SRC, rw.DST)
    assert renumbered["placement_bound"] == bound
    assert renumbered["sent"] == renumbered["planned_moved"] == bound < given["sent"]
    assert [g["renumbered"]["new_rank"] for g in got] == renumbered["dst_of"]
    assert sorted(r for r in renumbered["dst_of"] if r is not None) == [0, 1]
    assert renumbered["dst_of"][2] == 1 or renumbered["dst_of"][3] == 1
