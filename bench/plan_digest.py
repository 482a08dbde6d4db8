"""How long the processes of a live transfer take to agree on a plan: ``Plan.digest()`` at scale.

Plans GPT-3 175B (distributed optimizer, ``--layers`` layers) from
``dp=8,tp=8,pp=16`` to ``dp=32,tp=8,pp=8`` (1024 -> 2048 ranks), then times,
side by side in one run: ``make_plan``, ``Plan.digest()`` (xxh3-128 of a
canonical header and the op table's raw columns), ``hash(plan)``, and, for
scale, ``Plan.dumps()`` (the canonical JSON an agreement could have compared
instead). The digest is computed on a fresh copy of the plan each time (it
is cached on the plan). The last line is one JSON object.

Usage: python bench/plan_digest.py [--layers 96] [--repeat 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from tenplex.models import GPT3_175B, gpt_tree
    from tenplex.ptree import ParallelConfig
    from tenplex.transform import make_plan
    from tenplex.transform.plan import Plan

    tree = gpt_tree(dataclasses.replace(GPT3_175B, num_layers=args.layers))
    a, b = ParallelConfig.parse("dp=8,tp=8,pp=16"), ParallelConfig.parse("dp=32,tp=8,pp=8")
    t0 = time.perf_counter()
    plan = make_plan(tree, a, b)
    plan_s = time.perf_counter() - t0
    ops = len(plan.table)
    fresh = lambda: dataclasses.replace(plan)  # the same columns, no cached digest
    digest_s = best(lambda: fresh().digest(), args.repeat)
    hash_s = best(lambda: hash(fresh()), args.repeat)
    dumps_s = best(lambda: plan.dumps(), 1)
    assert fresh().digest() == plan.digest() and Plan.from_json(plan.to_json()).digest() == plan.digest()
    print(f"plan {a} -> {b}: {ops:,} ops, {plan.table.cols['offsets'].nbytes * 2 / 1e6:.0f} MB "
          f"of box columns")
    print(f"make_plan {plan_s:.3f} s; digest {digest_s * 1e3:.1f} ms; hash {hash_s * 1e3:.1f} ms; "
          f"canonical JSON {dumps_s:.3f} s")
    print(json.dumps({"ops": ops, "plan_s": round(plan_s, 4), "digest_s": round(digest_s, 5),
                      "hash_s": round(hash_s, 5), "dumps_s": round(dumps_s, 4),
                      "digest_over_plan": round(digest_s / plan_s, 5),
                      "digest_ms_per_million_ops": round(digest_s * 1e9 / max(ops, 1), 3)}))


if __name__ == "__main__":
    main()
