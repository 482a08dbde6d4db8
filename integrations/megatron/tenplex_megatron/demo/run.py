"""``tenplex demo``: elastic Megatron GPT training on real text through changing (dp, tp, pp).

The elastic run follows the schedule. Consecutive phases with the same
number of workers form one group of processes, and the state moves between
their phases live (``tenplex.reconfigure``). Between groups the workers are
restarted: the old ones stage the state to a host-memory store, and the new
ones load it. Two static runs of the same number of steps at fixed configs
give the reference curve and the rounding noise that a change of reduction
order alone causes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import socket
import tempfile
import time

from tenplex.errors import TenplexError
from tenplex.ptree.config import ParallelConfig

from tenplex_megatron.config import MegatronConfig
from tenplex_megatron.demo.schedule import DEFAULT_SCHEDULE, Phase, capacity, check_schedule, parse_schedule

__all__ = ["main", "build_parser", "run_demo"]

MODELS = {
    "small": dict(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512),
    "tiny": dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64),
    "medium": dict(num_layers=8, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024),
}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="tenplex demo", description=__doc__.splitlines()[0])
    p.add_argument("--schedule", default=DEFAULT_SCHEDULE,
                   help=f"phases 'dp=D,tp=T,pp=P:STEPS;...' (default {DEFAULT_SCHEDULE})")
    p.add_argument("--steps", type=int, default=None, help="steps per phase (overrides the schedule's)")
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--batch", type=int, default=8, help="global batch size in samples (default 8)")
    p.add_argument("--seq", type=int, default=64, help="sequence length in bytes (default 64)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="tenplex-demo", help="output directory (default ./tenplex-demo)")
    p.add_argument("--store", default=None,
                   help="where to stage state for restarts (default: a temporary directory, "
                        "under /dev/shm when it exists)")
    p.add_argument("--static", default=None, help="the two static configs, 'A;B' "
                   "(default: the first and the last phase's configs)")
    p.add_argument("--max-workers", type=int, default=None,
                   help=f"workers this machine may hold (default 2 per core: {capacity()})")
    p.add_argument("--no-plot", action="store_true")
    return p


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_config(args) -> MegatronConfig:
    # bytes: 256 tokens; make_vocab_size_divisible_by = 64 pads 256 to 256 at tp = 1, 2 and 4,
    # so Megatron's cross-entropy runs over the same padded vocabulary at every tp
    return MegatronConfig(**MODELS[args.model], vocab_size=256, make_vocab_size_divisible_by=64,
                          position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                          max_position_embeddings=args.seq, normalization="LayerNorm",
                          add_bias_linear=True)


def _groups(phases: list[Phase]) -> list[list[Phase]]:
    groups: list[list[Phase]] = []
    for phase in phases:
        if groups and groups[-1][-1].workers == phase.workers:
            groups[-1].append(phase)
        else:
            groups.append([phase])
    return groups


class _Runner:
    def __init__(self, args, cfg: MegatronConfig, store_root: str):
        self.args, self.cfg, self.store_root = args, cfg, store_root
        self.ctx = mp.get_context("spawn")
        self.train_args = {"seq": args.seq, "batch": args.batch, "lr": args.lr, "seed": args.seed,
                           "corpus_bytes": 4 << 20}

    def run(self, name: str, phases: list[Phase], show) -> dict:
        """Run ``phases``; returns ``{"steps": [...], "reconfigs": [...]}``."""
        steps, reconfigs = [], []
        staged = None
        start_index = 0
        groups = _groups(phases)
        for g, group in enumerate(groups):
            staged_out = None if g == len(groups) - 1 else f"{self.store_root}/{name}-{g}"
            q = self.ctx.Queue()
            port = _port()
            world = group[0].workers
            t_start = time.perf_counter()
            procs = [self.ctx.Process(target=_target, args=(r, world, port, name, group, start_index,
                                                            self.cfg.to_json(), self.train_args,
                                                            staged, staged_out, q))
                     for r in range(world)]
            for p in procs:
                p.start()
            done = set()
            while len(done) < world:
                try:
                    item = q.get(timeout=5)
                except queue_mod.Empty:
                    if any(p.exitcode not in (None, 0) for p in procs):
                        for p in procs:
                            p.kill()
                        raise TenplexError(f"demo run {name}: a worker died (exit codes "
                                           f"{[p.exitcode for p in procs]})")
                    continue
                kind = item[0]
                if kind == "step":
                    _, _, phase, step, loss, idx = item
                    steps.append({"phase": phase, "step": step, "loss": loss, "samples": idx,
                                  "config": str(phases[phase].config)})
                    show(name, phases, phase, step, loss)
                elif kind == "reconfig":
                    _, _, phase, how, seconds, moved, lower = item
                    reconfigs.append({"phase": phase, "how": how, "seconds": seconds, "moved": moved,
                                      "lower_bound": lower, "startup_s": time.perf_counter() - t_start
                                      if how == "restart: load" else 0.0})
                elif kind == "done":
                    done.add(item[2])
                elif kind == "error":
                    for p in procs:
                        p.kill()
                    raise TenplexError(f"demo run {name}, worker {item[2]} failed:\n{item[3]}")
            for p in procs:
                p.join()
            staged = staged_out
            start_index += len(group)
        return {"steps": steps, "reconfigs": reconfigs}


def _target(*args):
    from tenplex_megatron.demo.trainer import run_group
    run_group(*args)


def _show(name, phases, phase, step, loss) -> None:
    total = sum(p.steps for p in phases)
    print(f"[{name:>8}] phase {phase + 1}/{len(phases)} {str(phases[phase].config):<16} "
          f"step {step:>3}/{total} loss {loss:.5f}", flush=True)


def run_demo(args) -> dict:
    """Run the demo; returns the summary (also written to ``args.out``)."""
    cfg = _model_config(args)
    from tenplex_megatron.demo.trainer import demo_tree
    tree = demo_tree(cfg)
    phases = parse_schedule(args.schedule)
    if args.steps is not None:
        phases = [Phase(p.config, args.steps) for p in phases]
    max_workers = args.max_workers or capacity()
    check_schedule(phases, tree, args.batch, max_workers)
    total = sum(p.steps for p in phases)
    if args.static:
        a, b = (ParallelConfig.parse(x) for x in args.static.split(";"))
    else:
        a, b = phases[0].config, phases[-1].config
    statics = [Phase(a, total), Phase(b, total)]
    check_schedule(statics, tree, args.batch, max_workers)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    store_root = args.store or tempfile.mkdtemp(prefix="tenplex-demo-", dir=shm)
    t0 = time.perf_counter()
    try:
        runner = _Runner(args, cfg, store_root)
        elastic = runner.run("elastic", phases, _show)
        static_a = runner.run("static-A", [statics[0]], _show)
        static_b = runner.run("static-B", [statics[1]], _show)
    finally:
        if args.store is None:
            shutil.rmtree(store_root, ignore_errors=True)
    from tenplex_megatron.demo.report import summarize, write_outputs
    summary = summarize(phases, statics, elastic, static_a, static_b, tree, time.perf_counter() - t0)
    summary["data"] = _data_source(args)
    write_outputs(summary, args.out, plot=not args.no_plot)
    return summary


def _data_source(args) -> str:
    from tenplex_megatron.demo.data import load_corpus
    corpus = load_corpus(args.seq, 4 << 20, args.seed)
    return f"{corpus.source} ({corpus.nbytes} bytes, {len(corpus.order)} samples of {args.seq + 1} bytes)"


def main(argv: list[str] | None = None, parsed=None) -> int:
    args = parsed or build_parser().parse_args(argv)
    summary = run_demo(args)
    from tenplex_megatron.demo.report import render_table
    print(render_table(summary))
    print(f"max |loss(elastic) - loss(static A)| = {summary['max_loss_diff']:.3g}; "
          f"static A vs static B spread = {summary['static_spread']:.3g}; "
          f"bit-exact steps: {summary['bit_exact_steps']}")
    print(f"wrote {args.out}/summary.json" + ("" if args.no_plot else f" and {args.out}/loss.png"))
    print(json.dumps({k: summary[k] for k in ("max_loss_diff", "static_spread", "samples_match",
                                               "steps", "seconds", "within_spread")}))
    return 0
