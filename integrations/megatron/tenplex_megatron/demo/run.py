"""``tenplex demo``: elastic Megatron GPT training on real text through changing (dp, tp, pp).

The elastic run follows the schedule: a real megatron-core GPT (its DDP,
distributed optimizer and pipeline schedules) trains, and between phases the
job moves live with :func:`tenplex_megatron.live.change`: export,
``tenplex.reconfigure``, new ``parallel_state``, rebuild, import. Workers
that a phase does not need are parked. Two static runs of the same number of
steps at fixed configs give the reference curve and the rounding noise that
a change of reduction order alone causes.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from tenplex.argtypes import positive_int
from tenplex.ptree.config import ParallelConfig

from tenplex_megatron.model.config import MegatronConfig
from tenplex_megatron.model.layouts import megatron_tree
from tenplex_megatron.demo.schedule import DEFAULT_SCHEDULE, Phase, capacity, check_schedule, parse_schedule

__all__ = ["main", "build_parser", "run_demo"]

MODELS = {
    "small": dict(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512),
    "tiny": dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64),
    "medium": dict(num_layers=8, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024),
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
CORPUS_BYTES = 4 << 20


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="tenplex demo", description=__doc__.splitlines()[0])
    p.add_argument("--schedule", default=DEFAULT_SCHEDULE,
                   help=f"phases 'dp=D,tp=T,pp=P:STEPS;...' (default {DEFAULT_SCHEDULE})")
    p.add_argument("--steps", type=positive_int, default=None, help="steps per phase (overrides the schedule's)")
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="parameter dtype (bf16: fp32 main params in the optimizer; default fp32)")
    p.add_argument("--batch", type=positive_int, default=8, help="global batch size in samples (default 8)")
    p.add_argument("--micro-batch", type=positive_int, default=2, help="micro-batch size in samples (default 2)")
    p.add_argument("--seq", type=positive_int, default=64, help="sequence length in bytes (default 64)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="tenplex-demo", help="output directory (default ./tenplex-demo)")
    p.add_argument("--static", default=None, help="the two static configs, 'A;B' "
                   "(default: the first and the last phase's configs)")
    p.add_argument("--max-workers", type=positive_int, default=None,
                   help=f"workers this machine may hold (default 2 per core: {capacity()})")
    p.add_argument("--no-plot", action="store_true")
    return p


def _model_config(args) -> MegatronConfig:
    # bytes: 256 tokens; make_vocab_size_divisible_by = 64 pads 256 to 256 at tp = 1, 2 and 4,
    # so Megatron's cross-entropy runs over the same padded vocabulary at every tp
    return MegatronConfig(**MODELS[args.model], vocab_size=256, make_vocab_size_divisible_by=64,
                          position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                          max_position_embeddings=args.seq, normalization="LayerNorm",
                          add_bias_linear=True, params_dtype=DTYPES[args.dtype])


def _options(args):
    from tenplex_megatron.demo.job import JobOptions
    return JobOptions(global_batch=args.batch, micro_batch=args.micro_batch, seq=args.seq, lr=args.lr,
                      seed=args.seed)


class _Records:
    """The workers' records, by run."""

    def __init__(self, runs, show):
        self.show, self.phases = show, dict(runs)
        self.runs = {name: {"steps": [], "reconfigs": []} for name, _ in runs}

    def __call__(self, item) -> None:
        kind, name, phase = item[0], item[1], item[2]
        phases = self.phases[name]
        if kind == "step":
            _, _, _, step, loss, idx = item
            self.runs[name]["steps"].append({"phase": phase, "step": step, "loss": loss, "samples": idx,
                                             "config": str(phases[phase].config)})
            self.show(name, phases, phase, step, loss)
        elif kind == "reconfig":
            _, _, _, seconds, transfer, sent, lower, bound = item
            self.runs[name]["reconfigs"].append({"phase": phase, "how": "live", "seconds": seconds,
                                                 "transfer_s": transfer, "moved": sent, "lower_bound": lower,
                                                 "placement_bound": bound})


def _show(name, phases, phase, step, loss) -> None:
    total = sum(p.steps for p in phases)
    print(f"[{name:>8}] phase {phase + 1}/{len(phases)} {str(phases[phase].config):<16} "
          f"step {step:>3}/{total} loss {loss:.5f}", flush=True)


def run_demo(args) -> dict:
    """Run the demo; returns the summary (also written to ``args.out``)."""
    from tenplex_megatron.demo.job import live_spec
    from tenplex_megatron.demo.trainer import run_worker
    from tenplex_megatron.demo.workers import run_workers

    cfg, opts = _model_config(args), _options(args)
    phases = parse_schedule(args.schedule)
    if args.steps is not None:
        phases = [Phase(p.config, args.steps) for p in phases]
    total = sum(p.steps for p in phases)
    if args.static:
        a, b = (ParallelConfig.parse(x) for x in args.static.split(";"))
    else:
        a, b = phases[0].config, phases[-1].config
    statics = [Phase(a, total), Phase(b, total)]
    max_workers = args.max_workers or capacity()
    check_schedule(phases + statics, megatron_tree(cfg), args.batch, max_workers, args.micro_batch)
    live_spec(cfg, opts).tree(*{p.config for p in phases + statics})   # megatron-core's layouts fit
    runs = [("elastic", phases), ("static-A", [statics[0]]), ("static-B", [statics[1]])]
    records = _Records(runs, _show)
    nprocs = max(p.workers for p in phases + statics)
    t0 = time.perf_counter()
    run_workers("demo", nprocs, run_worker, (runs, cfg.to_json(), asdict(opts), CORPUS_BYTES), records)
    from tenplex_megatron.demo.report import summarize, write_outputs
    summary = summarize(phases, statics, *(records.runs[n] for n, _ in runs), time.perf_counter() - t0)
    summary["data"] = _data_source(args)
    summary["dtype"] = args.dtype
    write_outputs(summary, args.out, plot=not args.no_plot)
    return summary


def _data_source(args) -> str:
    from tenplex_megatron.demo.data import load_corpus
    corpus = load_corpus(args.seq, CORPUS_BYTES, args.seed)
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
