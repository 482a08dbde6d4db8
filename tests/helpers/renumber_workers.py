"""Workers for the live renumbering test (4 gloo processes on CPU).

Each process holds old rank ``rank`` of ``SRC``; the change to ``DST`` is run with the given
numbering (``renumber=False``) and then, from the same old state, renumbered (the default). After each, a process
that holds a new rank checks its state bit for bit against ``materialize(global state, DST,
its new rank)``.
"""

import traceback

import tenplex
from tenplex.ptree import ParallelConfig as P, materialize

from tests.helpers import elastic_workers as w

SRC = P(dp=2, pp=2)   # process p: dp p % 2, stage p // 2
DST = P(dp=1, pp=2)   # 2 ranks; contiguous: new rank 1 (stage 1) on process 1, which holds stage 0


def _checked(state, rep, rank, truth, tensors, values):
    new = rep.dst_of[rank]
    if new is None:
        assert state is None
        return None
    w.check(state, DST, new, w.expected_values(values, SRC, DST), tensors)
    return new


def renumber(rank: int, port: int, out_dir: str) -> None:
    try:
        w.init(rank, 4, port)
        truth = w.global_state(SRC)
        tensors = {p: t for p, t in truth.items() if hasattr(t, "dtype")}
        values = {p: v for p, v in truth.items() if not hasattr(v, "dtype")}
        out = {}
        for name, kwargs in (("given", {"renumber": False}), ("renumbered", {})):
            local = materialize(w.TREE, truth, SRC, rank)
            state, rep = tenplex.reconfigure(local, w.TREE, SRC, DST, **kwargs)
            out[name] = {"new_rank": _checked(state, rep, rank, truth, tensors, values),
                         "sent": rep.sent, "planned_moved": rep.planned_moved,
                         "lower_bound": rep.lower_bound, "placement_bound": rep.placement_bound,
                         "dst_of": rep.dst_of}
        w.report(out_dir, f"renumber-{rank}", out)
        w.dist.destroy_process_group()
    except BaseException:
        w.report(out_dir, f"error-{rank}", traceback.format_exc())
        raise
