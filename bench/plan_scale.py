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

Usage: python bench/plan_scale.py [--layers 96] [--repeat 3]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
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
    print(json.dumps({
        "plan_s_1024_to_2048": round(results["1024_to_2048"]["plan_s"], 3),
        "plan_s_2048_to_1024": round(results["2048_to_1024"]["plan_s"], 3),
        "plan_s_moe_256_to_512": round(results["moe_256_to_512"]["plan_s"], 3),
        "peak_rss_mb": round(max(results[c]["peak_rss_mb"] for c in ("1024_to_2048", "2048_to_1024")), 1),
        "moved_over_lower_bound": round(max(r["moved_over_lower_bound"] for r in results.values()), 4),
    }))


if __name__ == "__main__":
    main()
