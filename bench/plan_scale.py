"""Planning at scale: GPT-3 175B with Adam (distributed optimizer), 1024 <-> 2048 GPUs.

Prints plan time and peak memory for each change, bytes moved against the
lower bound, and against the naive policy of the published Tenplex
prototype (every target reads from dp rank 0 of its source tp rank, unless
the data is already on its device). Each change is planned in a fresh child
process, so that peak RSS is per plan. A mixture-of-experts change follows
(64 experts in each of 24 layers, about 13,000 leaves, ep 8 -> 16 with
expert tp 1, 256 -> 512 ranks). The last line is one JSON object:
``plan_s_1024_to_2048``, ``plan_s_2048_to_1024``, ``plan_s_moe_256_to_512``,
``peak_rss_mb`` (the GPT-3 changes), ``moved_over_lower_bound``.

Llama-3.1-405B (126 layers, uneven pp 16: stages 7:8x14:7; distributed
Adam) at tp 8, pp 16 follows, dp 64 <-> 128 (8192 <-> 16384 GPUs), both
ways, each part in a fresh child process: whole-plan time and peak RSS;
own-rank plan time for the first, a middle and the last rank (the first
call in the process, which also makes the default placements, and a second
calls (the fastest is reported), wall and CPU time, with tracemalloc's
peak and the RSS growth; ``best_placement``'s time and peak RSS; bytes moved with the
contiguous and with the best placement, and the placement-free bound
(the smaller of the row- and column-maxima rules; the issue's row-only
rule is printed beside it). The last line then adds ``plan_s_405b``,
``plan_rss_mb_405b``, ``own_rank_plan_ms_405b`` (the slowest of the six),
``own_rank_first_call_ms_405b``, ``placement_s_405b``,
``best_moved_over_placement_bound`` (the worse way) and the bytes, and
``best_numbering``'s time and peak RSS as every process of a live change runs
it (``renumber_s_405b``, ``renumber_cpu_s_405b``, ``renumber_rss_mb_405b``,
per way).

Usage: python bench/plan_scale.py [--layers 96] [--repeat 3] [--only-405b]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import time

import numpy as np

CHANGES = {
    "1024_to_2048": ("gpt3", "dp=8,tp=8,pp=16", "dp=32,tp=8,pp=8"),
    "2048_to_1024": ("gpt3", "dp=32,tp=8,pp=8", "dp=8,tp=8,pp=16"),
    "moe_256_to_512": ("moe", "dp=32,tp=2,pp=4,ep=8,etp=1", "dp=64,tp=2,pp=4,ep=16,etp=1"),
}


def bench_spec(name: str, layers: int):
    """GPT-3 175B (with ``layers``), or a DeepSeek-V2-Lite-sized MoE (24 layers, 64 experts)."""
    import dataclasses

    from tenplex.models import GPT3_175B, GPTSpec

    if name == "gpt3":
        return dataclasses.replace(GPT3_175B, num_layers=layers)
    return GPTSpec(num_layers=24, hidden=2048, heads=16, query_groups=16, ffn=10944,
                   vocab=102400, seq_len=4096, swiglu=True, tied=False, rope=True, bias=False,
                   layernorm=False, dtype="bfloat16", optimizer="distributed_adam",
                   num_experts=64, moe_ffn=1408, topk=6, shared_expert_ffn=2816)


def naive_moved(plan) -> tuple[int, int]:
    """Bytes moved, and the busiest sender's bytes, if every target read from dp rank 0
    of the source (the published prototype's policy)."""
    from tenplex.transform.plan import KIND_CODE, OpKind

    c = plan.table.cols
    copy = c["kind"] != KIND_CODE[OpKind.FILL]
    src, dst = c["src"][copy], c["dst"][copy]
    rank0 = np.array([plan.src.rank(plan.src.coord(r)._replace(dp=0))
                      for r in range(plan.src.world_size)])
    devices = {d: i for i, d in enumerate(sorted(set(plan.src_placement.devices)
                                                 | set(plan.dst_placement.devices)))}
    dev_src = np.array([devices[d] for d in plan.src_placement.devices])
    dev_dst = np.array([devices[d] for d in plan.dst_placement.devices])
    moved = dev_src[rank0[src]] != dev_dst[dst]
    sent = np.bincount(rank0[src][moved], weights=c["nbytes"][copy][moved])
    return int(c["nbytes"][copy][moved].sum()), int(sent.max()) if len(sent) else 0


def run_one(layers: int, change: str, repeat: int, queue) -> None:
    from tenplex.models import gpt_tree
    from tenplex.ptree import ParallelConfig
    from tenplex.transform import make_plan

    name, *configs = CHANGES[change]
    tree = gpt_tree(bench_spec(name, layers))
    a, b = (ParallelConfig.parse(x) for x in configs)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = make_plan(tree, a, b)
        times.append(time.perf_counter() - t0)
    t = plan.totals
    # the prototype's policy knows no experts: it is compared on the dense GPT-3 changes only
    naive = naive_moved(plan) if name == "gpt3" else (float("nan"), float("nan"))
    queue.put({
        "change": change, "src": str(a), "dst": str(b), "leaves": len(tree),
        "ops": len(plan.ops), "plan_s": min(times), "plan_s_all": times,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "needed_gb": t.needed / 1e9, "moved_gb": t.moved / 1e9, "lower_bound_gb": t.lower_bound / 1e9,
        "network_gb": t.network / 1e9, "max_sender_gb": t.max_sender / 1e9,
        "naive_moved_gb": naive[0] / 1e9, "naive_max_sender_gb": naive[1] / 1e9,
        "moved_over_lower_bound": t.moved / t.lower_bound if t.lower_bound else 1.0,
        "senders_even_share_gb": t.moved / plan.src.world_size / 1e9,
    })


LLAMA_405B_CHANGES = {"8192_to_16384": (64, 128), "16384_to_8192": (128, 64)}


def llama_405b():
    """Llama-3.1-405B's tree and its config at ``dp`` (tp 8, pp 16, stages 7:8x14:7)."""
    from tenplex.models import GPTSpec, gpt_tree
    from tenplex.ptree import ParallelConfig

    spec = GPTSpec(num_layers=126, hidden=16384, heads=128, query_groups=8, ffn=53248,
                   vocab=128256, seq_len=8192, swiglu=True, tied=False, rope=True, bias=False,
                   layernorm=False, dtype="bfloat16", optimizer="distributed_adam")
    stages = "stages=7:" + ":".join(["8"] * 14) + ":7"
    return gpt_tree(spec), lambda dp: ParallelConfig.parse(f"dp={dp},tp=8,pp=16,{stages}")


def run_405b_whole(change: str, queue) -> None:
    """The whole plan with the contiguous placement: time, peak RSS, bytes moved."""
    from tenplex.transform import make_plan

    tree, config = llama_405b()
    a, b = (config(dp) for dp in LLAMA_405B_CHANGES[change])
    t0 = time.perf_counter()
    plan = make_plan(tree, a, b)
    plan_s = time.perf_counter() - t0
    queue.put({"plan_s": plan_s, "plan_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "ops": len(plan.ops), "needed_tb": plan.totals.needed / 1e12,
               "moved_tb": plan.totals.moved / 1e12, "lower_bound_tb": plan.totals.lower_bound / 1e12})


def run_405b_placement(change: str, queue) -> None:
    """best_placement's time and peak RSS, the bounds, and the bytes moved with its placement."""
    import scipy.optimize
    import scipy.sparse.csgraph  # noqa: F401 (imported before timing, as the planner's caller has)

    from tenplex.transform import make_plan
    from tenplex.transform.assign import best_placement, weight_blocks
    from tenplex.transform.placement import Placement

    tree, config = llama_405b()
    a, b = (config(dp) for dp in LLAMA_405B_CHANGES[change])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    c0 = time.process_time()
    best = best_placement(tree, a, b, Placement.contiguous(a.world_size))
    placement_s, placement_cpu = time.perf_counter() - t0, time.process_time() - c0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    needed, blocks = weight_blocks(tree, a, b)
    rows = sum(int(k.weight.max(axis=1).sum()) for k in blocks)
    cols = sum(int(k.weight.max(axis=0).sum()) for k in blocks)
    bound_s = time.perf_counter() - t0
    moved = make_plan(tree, a, b, dst_placement=best).totals.moved
    queue.put({"placement_s": placement_s, "placement_cpu_s": placement_cpu, "placement_rss_mb": rss, "rss_before_mb": before,
               "bound_s": bound_s, "blocks": len(blocks),
               "largest_block": max((k.weight.shape for k in blocks), default=(0, 0)),
               "bound_tb": (needed - min(rows, cols)) / 1e12, "row_bound_tb": (needed - rows) / 1e12,
               "best_moved_tb": moved / 1e12})


def run_405b_numbering(change: str, queue) -> None:
    """``best_numbering`` as ``reconfigure(renumber=True)`` calls it on every process of a live
    change (process ``p`` holds old rank ``p``; the given numbering is the contiguous one):
    wall and CPU time (the fastest of three calls, and the first), peak RSS, and the bytes its
    numbering keeps against the given one's."""
    from tenplex.transform.assign import best_numbering, import_solvers

    import_solvers()  # a live job imports them at start (Membership)
    tree, config = llama_405b()
    a, b = (config(dp) for dp in LLAMA_405B_CHANGES[change])
    size = max(a.world_size, b.world_size)
    src_of = [p if p < a.world_size else None for p in range(size)]
    given = [p if p < b.world_size else None for p in range(size)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    runs, cpus = [], []
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        dst_of, bound = best_numbering(tree, a, b, src_of, range(a.world_size), given=given)
        runs.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    queue.put({"numbering_s": min(runs), "numbering_cpu_s": min(cpus), "numbering_first_s": runs[0],
               "numbering_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "numbering_rss_before_mb": before, "renumbered": dst_of != given,
               "numbering_bound_tb": bound / 1e12})


def run_405b_own(change: str, queue) -> None:
    """Own-rank plans of the first, a middle and the last rank: the first call in this process
    (cold: it also makes the default placements and the shardings) and again (warm)."""
    import tracemalloc

    from tenplex.transform import make_plan

    tree, config = llama_405b()
    a, b = (config(dp) for dp in LLAMA_405B_CHANGES[change])
    out = []
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for rank in (0, b.world_size // 2, b.world_size - 1):
        t0, c0 = time.perf_counter(), time.process_time()
        plan = make_plan(tree, a, b, ranks=[rank])
        first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
        again, again_cpu = [], []
        for _ in range(3):
            t0, c0 = time.perf_counter(), time.process_time()
            make_plan(tree, a, b, ranks=[rank])
            again.append(time.perf_counter() - t0)
            again_cpu.append(time.process_time() - c0)
        tracemalloc.start()
        make_plan(tree, a, b, ranks=[rank])
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        out.append({"rank": rank, "first_ms": first * 1e3, "first_cpu_ms": first_cpu * 1e3,
                    "ms": min(again) * 1e3, "cpu_ms": min(again_cpu) * 1e3,
                    "ops": len(plan.ops), "traced_mb": peak / 2**20,
                    "rss_growth_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base})
    queue.put(out)


def _child(ctx, target, *args):
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get(timeout=1800)
    proc.join()
    return result


def bench_405b(ctx) -> dict:
    """The Llama-3.1-405B changes; prints their lines and returns the last line's keys."""
    whole, own, place, number = {}, {}, {}, {}
    for change in LLAMA_405B_CHANGES:
        whole[change] = w = _child(ctx, run_405b_whole, change)
        own[change] = o = _child(ctx, run_405b_own, change)
        place[change] = p = _child(ctx, run_405b_placement, change)
        number[change] = n = _child(ctx, run_405b_numbering, change)
        print(f"405B {change}: whole plan {w['plan_s']:.2f}s peak_rss={w['plan_rss_mb']:.0f}MB "
              f"ops={w['ops']:,}; needed {w['needed_tb']:.1f}TB")
        print("      own-rank plans: " + ", ".join(
            f"rank {r['rank']} {r['ms']:.0f}ms (cpu {r['cpu_ms']:.0f}ms; first call "
            f"{r['first_ms']:.0f}ms, cpu {r['first_cpu_ms']:.0f}ms; {r['ops']} ops, "
            f"traced {r['traced_mb']:.1f}MB, rss +{r['rss_growth_mb']:.0f}MB)" for r in o))
        print(f"      best placement {p['placement_s']:.2f}s (cpu {p['placement_cpu_s']:.2f}s) peak_rss={p['placement_rss_mb']:.0f}MB "
              f"(before {p['rss_before_mb']:.0f}MB; {p['blocks']} blocks, largest "
              f"{p['largest_block'][0]}x{p['largest_block'][1]})")
        print(f"      moved: contiguous {w['moved_tb']:.2f}TB, best placement {p['best_moved_tb']:.2f}TB; "
              f"placement-free bound {p['bound_tb']:.2f}TB (row maxima only, the issue's rule: "
              f"{p['row_bound_tb']:.2f}TB; {p['bound_s']:.1f}s)")
        print(f"      renumbering (best_numbering, every process of a live change) {n['numbering_s']:.3f}s "
              f"(cpu {n['numbering_cpu_s']:.3f}s; first call {n['numbering_first_s']:.3f}s) "
              f"peak_rss={n['numbering_rss_mb']:.0f}MB (before {n['numbering_rss_before_mb']:.0f}MB); "
              f"renumbered: {n['renumbered']}")
    ratio = [p["best_moved_tb"] / p["bound_tb"] if p["bound_tb"] else 1.0 for p in place.values()]
    return {
        "plan_s_405b": round(max(w["plan_s"] for w in whole.values()), 3),
        "plan_rss_mb_405b": round(max(w["plan_rss_mb"] for w in whole.values()), 1),
        "own_rank_plan_ms_405b": round(max(r["ms"] for o in own.values() for r in o), 1),
        "own_rank_plan_cpu_ms_405b": round(max(r["cpu_ms"] for o in own.values() for r in o), 1),
        "own_rank_first_call_ms_405b": round(max(r["first_ms"] for o in own.values() for r in o), 1),
        "own_rank_traced_mb_405b": round(max(r["traced_mb"] for o in own.values() for r in o), 1),
        "placement_s_405b": round(max(p["placement_s"] for p in place.values()), 3),
        "placement_cpu_s_405b": round(max(p["placement_cpu_s"] for p in place.values()), 3),
        "placement_rss_mb_405b": round(max(p["placement_rss_mb"] for p in place.values()), 1),
        "best_moved_over_placement_bound": round(max(ratio), 4),
        "renumber_s_405b": {c: round(n["numbering_s"], 3) for c, n in number.items()},
        "renumber_cpu_s_405b": {c: round(n["numbering_cpu_s"], 3) for c, n in number.items()},
        "renumber_rss_mb_405b": {c: round(n["numbering_rss_mb"], 1) for c, n in number.items()},
        "placement_bound_tb_405b": {c: round(p["bound_tb"], 3) for c, p in place.items()},
        "moved_tb_405b": {c: {"contiguous": round(whole[c]["moved_tb"], 3),
                              "best": round(p["best_moved_tb"], 3)} for c, p in place.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only-405b", action="store_true", help="run only the Llama-3.1-405B changes")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    if args.only_405b:
        print(json.dumps(bench_405b(ctx)))
        return
    results = {}
    for change in CHANGES:
        queue = ctx.Queue()
        proc = ctx.Process(target=run_one, args=(args.layers, change, args.repeat, queue))
        proc.start()
        results[change] = queue.get(timeout=600)
        proc.join()
    for change, r in results.items():
        print(f"{r['src']:>18} -> {r['dst']:<18} leaves={r['leaves']} ops={r['ops']:,} "
              f"plan={r['plan_s']:.2f}s (runs {', '.join(f'{x:.2f}' for x in r['plan_s_all'])}) "
              f"peak_rss={r['peak_rss_mb']:.0f}MB")
        print(f"{'':>18}    needed={r['needed_gb']:.1f}GB moved={r['moved_gb']:.1f}GB "
              f"lower_bound={r['lower_bound_gb']:.1f}GB network={r['network_gb']:.1f}GB "
              f"naive_policy_moved={r['naive_moved_gb']:.1f}GB "
              f"(naive/ours={r['naive_moved_gb'] / max(r['moved_gb'], 1e-12):.2f}) "
              f"busiest_sender={r['max_sender_gb']:.2f}GB (naive {r['naive_max_sender_gb']:.2f}GB, "
              f"even share {r['senders_even_share_gb']:.2f}GB)")
    scaling = []
    for layers in (32, 64, 96):
        queue = ctx.Queue()
        proc = ctx.Process(target=run_one, args=(layers, "1024_to_2048", 1, queue))
        proc.start()
        r = queue.get(timeout=600)
        proc.join()
        scaling.append(r)
        print(f"scaling: layers={layers} leaves={r['leaves']} ops={r['ops']:,} plan={r['plan_s']:.2f}s "
              f"({r['plan_s'] / r['leaves'] * 1e3:.3f} ms/leaf)")
    last = bench_405b(ctx)
    print(json.dumps({
        **last,
        "plan_s_1024_to_2048": round(results["1024_to_2048"]["plan_s"], 3),
        "plan_s_2048_to_1024": round(results["2048_to_1024"]["plan_s"], 3),
        "plan_s_moe_256_to_512": round(results["moe_256_to_512"]["plan_s"], 3),
        "peak_rss_mb": round(max(results[c]["peak_rss_mb"] for c in ("1024_to_2048", "2048_to_1024")), 1),
        "moved_over_lower_bound": round(max(r["moved_over_lower_bound"] for r in results.values()), 4),
    }))


if __name__ == "__main__":
    main()
