"""The demo's results: per-phase table, loss plot, JSON summary."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter


__all__ = ["summarize", "render_table", "write_outputs"]


def _losses(run: dict) -> list[float]:
    return [s["loss"] for s in sorted(run["steps"], key=lambda s: s["step"])]


def _samples(run: dict) -> Counter:
    return Counter(i for s in run["steps"] for i in s["samples"])


def summarize(phases, statics, elastic, static_a, static_b, seconds: float) -> dict:
    """The demo's results: per-phase rows, the three loss curves and how they compare."""
    ea, sa, sb = _losses(elastic), _losses(static_a), _losses(static_b)
    diffs = [abs(x - y) for x, y in zip(ea, sa)]
    spread = max((abs(x - y) for x, y in zip(sa, sb)), default=0.0)
    exact = [i + 1 for i, (x, y) in enumerate(zip(ea, sa)) if x == y]
    rows, start = [], 0
    for i, phase in enumerate(phases):
        steps = [s for s in elastic["steps"] if s["phase"] == i]
        row = {"phase": i + 1, "config": str(phase.config), "workers": phase.workers,
               "steps": f"{start + 1}-{start + phase.steps}", "last_loss": steps[-1]["loss"] if steps else None,
               "change": "start", "reconfig_s": 0.0, "transfer_s": 0.0, "moved": 0, "lower_bound": 0,
               "placement_bound": 0}
        for r in (r for r in elastic["reconfigs"] if r["phase"] == i):
            row.update(change="live", reconfig_s=r["seconds"], transfer_s=r["transfer_s"], moved=r["moved"],
                       lower_bound=r["lower_bound"], placement_bound=r.get("placement_bound"))
        rows.append(row)
        start += phase.steps
    return {
        "phases": rows,
        "steps": len(ea),
        "elastic_loss": ea, "static_a_loss": sa, "static_b_loss": sb,
        "static_a": str(statics[0].config), "static_b": str(statics[1].config),
        "max_loss_diff": max(diffs, default=0.0),
        "static_spread": spread,
        "within_spread": max(diffs, default=0.0) <= max(spread, 1e-12) or max(diffs, default=0.0) == 0.0,
        "bit_exact_steps": _ranges(exact),
        "samples_match": _samples(elastic) == _samples(static_a),
        "samples_per_run": sum(_samples(elastic).values()),
        "changes": [sum(p.steps for p in phases[:i]) + 0.5 for i in range(1, len(phases))],
        "seconds": round(seconds, 1),
    }


def _ranges(steps: list[int]) -> str:
    if not steps:
        return "none"
    out, a, b = [], steps[0], steps[0]
    for s in steps[1:]:
        if s == b + 1:
            b = s
        else:
            out.append(f"{a}-{b}" if a != b else str(a))
            a = b = s
    out.append(f"{a}-{b}" if a != b else str(a))
    return ", ".join(out)


def _moved(r: dict) -> str:
    """Bytes moved, the plan's lower bound (its numbering) and the placement-free bound, in MB."""
    bound = r.get("placement_bound")
    return (f"{r['moved'] / 1e6:.2f} MB / {r['lower_bound'] / 1e6:.2f} MB / "
            + (f"{bound / 1e6:.2f} MB" if bound is not None else "-"))


def render_table(summary: dict) -> str:
    header = ["phase", "config", "workers", "steps", "last loss", "change", "change s", "transfer s",
              "moved / lower bound / placement bound"]
    rows = [[str(r["phase"]), r["config"], str(r["workers"]), r["steps"],
             f"{r['last_loss']:.5f}" if r["last_loss"] is not None else "-", r["change"],
             f"{r['reconfig_s']:.2f}" if r["phase"] > 1 else "-",
             f"{r['transfer_s']:.2f}" if r["phase"] > 1 else "-",
             _moved(r) if r["phase"] > 1 else "-"]
            for r in summary["phases"]]
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _plot(summary: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, summary["steps"] + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    top.plot(steps, summary["static_a_loss"], "-", color="0.6", lw=3, label=f"static {summary['static_a']}")
    top.plot(steps, summary["static_b_loss"], ":", color="tab:green", label=f"static {summary['static_b']}")
    top.plot(steps, summary["elastic_loss"], "o-", ms=3, color="tab:blue", label="elastic (tenplex)")
    diff = [abs(a - b) for a, b in zip(summary["elastic_loss"], summary["static_a_loss"])]
    bottom.semilogy(steps, [max(d, 1e-10) for d in diff], ".-", color="tab:blue")
    bottom.set_ylabel("|elastic - static A|")
    bottom.text(0.01, 0.05, "points at 1e-10: bit-exact (0)", transform=bottom.transAxes, fontsize=7,
                color="0.4")
    for x, row in zip(summary["changes"], summary["phases"][1:]):
        for ax in (top, bottom):
            ax.axvline(x, color="tab:red", lw=0.8, ls="--")
        top.text(x, top.get_ylim()[1], f" {row['config']}\n {row['change'].split()[0]}",
                 va="top", fontsize=7, color="tab:red")
    top.set_ylabel("training loss")
    top.set_title("Megatron GPT on Python stdlib source: elastic vs static")
    top.legend(loc="lower left", fontsize=8)
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(summary: dict, out: str, plot: bool = True) -> None:
    """Write ``summary.json``, ``table.txt`` and ``loss.png`` to ``out`` (replaced as a whole)."""
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tenplex-demo-", dir=parent)
    try:
        with open(os.path.join(tmp, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        with open(os.path.join(tmp, "table.txt"), "w") as f:
            f.write(render_table(summary) + "\n")
        if plot:
            _plot(summary, os.path.join(tmp, "loss.png"))
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
