"""What must move: the planner makes a Plan; executors run it."""

from tenplex.transform.assign import best_placement, bytes_in_common
from tenplex.transform.local import ExecStats, execute_local
from tenplex.transform.placement import Device, Placement
from tenplex.transform.plan import CopyOp, Link, OpKind, Plan, Totals, ValueOp
from tenplex.transform.planner import make_plan

__all__ = ["CopyOp", "Device", "ExecStats", "Link", "OpKind", "Placement", "Plan", "Totals",
           "ValueOp", "best_placement", "bytes_in_common", "execute_local", "make_plan"]
