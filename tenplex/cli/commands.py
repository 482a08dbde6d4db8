"""The CLI's commands; each takes parsed arguments and returns an exit code."""

from __future__ import annotations

import contextlib
import json
import sys
import time
import uuid

import fsspec

from tqdm import tqdm

from tenplex.cli.formats import TENPLEX, detect, formats
from tenplex.cli.render import matrix, size, table
from tenplex.errors import ConfigError
from tenplex.ptree.sharding import Sharding
from tenplex.store.reader import StoreReader
from tenplex.transform.placement import Placement
from tenplex.transform.planner import make_plan

__all__ = ["reshard", "inspect", "plan", "verify", "example", "demo"]


def _as_store(path: str, tmp: str, args=None) -> tuple[str, str]:
    """A tenplex store URL for ``path`` and its format; a plugin format is converted into ``tmp``."""
    fmt = detect(path)
    if fmt == TENPLEX:
        return path, fmt
    options = {"model_config": getattr(args, "model_config", None)}
    formats()[fmt].to_store(path, tmp, **options)
    return tmp, fmt


@contextlib.contextmanager
def _scratch():
    """A scratch store root in memory (``memory://``), removed afterwards."""
    url = f"memory://tenplex-cli-{uuid.uuid4().hex}"
    try:
        yield url
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(url.removeprefix("memory://")):
            fs.rm(url.removeprefix("memory://"), recursive=True)


def reshard(args) -> int:
    from tenplex.api import reshard as run

    start = time.perf_counter()
    plugins = formats()
    src_fmt = detect(args.src)
    direct = getattr(plugins.get(src_fmt), "reshard", None)
    if direct is not None and args.format in (None, src_fmt):
        # a plugin format whose files are already global (megatron-dist): no regions move
        report = direct(args.src, args.dst, args.to, model_config=getattr(args, "model_config", None))
        if report is not None:
            summary = {"src": src_fmt, "dst": str(args.to), "format": src_fmt,
                       "seconds": time.perf_counter() - start, **report}
            print(json.dumps(summary) if args.json else
                  f"resharded {args.src} -> {args.to} ({src_fmt}, model-space tensors rewritten "
                  f"directly) in {summary['seconds']:.2f} s")
            return 0
    with _scratch() as tmp:
        src, src_fmt = _as_store(args.src, f"{tmp}/source", args)
        out_fmt = args.format or src_fmt
        if out_fmt != TENPLEX and out_fmt not in plugins:
            raise ConfigError(f"--format {out_fmt}: unknown; expected one of "
                              f"{', '.join([TENPLEX] + sorted(plugins))}")
        if out_fmt != TENPLEX:
            # the plugin's writer pulls each target rank from the source store through the planner
            report = plugins[out_fmt].from_store(src, args.dst, to=args.to)
            summary = {"src": str(StoreReader(src).config), "dst": str(args.to), "format": out_fmt,
                       "seconds": time.perf_counter() - start, **(report or {})}
            print(json.dumps(summary) if args.json else
                  f"resharded {summary['src']} -> {summary['dst']} ({src_fmt} -> {out_fmt}) "
                  f"in {summary['seconds']:.2f} s")
            return 0
        bar = tqdm(total=0, unit="B", unit_scale=True, desc="reshard", disable=None, file=sys.stderr)

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        try:
            report = run(src, args.dst, args.to, threads=args.threads, progress=progress)
        finally:
            bar.close()
    for line in report.padding:
        print(f"padding: {line}", file=sys.stderr)
    if args.json:
        print(json.dumps({"src": str(report.src), "dst": str(report.dst), "format": out_fmt,
                          "bytes_read": report.bytes_read, "bytes_needed": report.bytes_needed,
                          "bytes_written": report.bytes_written, "seconds": report.seconds,
                          "padding": report.padding}))
    else:
        print(report.summary())
    return 0


def _open(path: str, args) -> tuple[StoreReader, str]:
    """The manifest of the checkpoint at ``path`` (any format) and its format name."""
    with _scratch() as tmp:
        url, fmt = _as_store(path, tmp, args)
        return StoreReader(url), fmt


def inspect(args) -> int:
    reader, fmt = _open(args.path, args)
    tree, config = reader.tree, reader.config
    sharding = Sharding(tree, config)
    rows, total = [], 0
    for path, leaf in tree.leaves.items():
        if hasattr(leaf, "shape"):
            n = leaf.itemsize
            for s in leaf.shape:
                n *= s
            total += n
            rows.append({"path": path, "shape": list(leaf.shape), "dtype": leaf.dtype,
                         "layout": str(leaf.layout), "bytes": n,
                         "ranks": len(sharding.ranks_holding(path))})
        else:
            rows.append({"path": path, "value": reader.manifest.values.get(path),
                         "scope": leaf.scope.value})
    stored = sum(f.size for f in reader.manifest.files.values())
    if args.json:
        print(json.dumps({"format": fmt, "config": config.to_json(), "num_layers": tree.num_layers,
                          "leaves": rows, "logical_bytes": total, "stored_bytes": stored,
                          "files": len(reader.manifest.files), "meta": reader.manifest.meta}))
        return 0
    print(f"{args.path}: {fmt} checkpoint, config {config}, {tree.num_layers} layers")
    print(table([[r["path"], "x".join(map(str, r["shape"])), r["dtype"], r["layout"], size(r["bytes"])]
                 for r in rows if "shape" in r], ["path", "shape", "dtype", "layout", "size"]))
    values = [r for r in rows if "shape" not in r]
    if values:
        print(table([[r["path"], r["scope"], json.dumps(r["value"])[:60]] for r in values],
                    ["value", "scope", "content"]))
    print(f"total: {len(rows)} leaves, {size(total)} logical, {size(stored)} stored in "
          f"{len(reader.manifest.files)} files")
    return 0


def plan(args) -> int:
    reader, _ = _open(args.path, args)
    src, dst = reader.config, args.to
    src_pl = Placement.contiguous(src.world_size, args.per_host)
    dst_pl = Placement.contiguous(dst.world_size, args.per_host)
    if args.best_placement:
        from tenplex.transform.assign import best_placement
        pool = list(Placement.contiguous(max(src.world_size, dst.world_size), args.per_host).devices)
        dst_pl = best_placement(reader.tree, src, dst, src_pl, pool)
    p = make_plan(reader.tree, src, dst, src_placement=src_pl, dst_placement=dst_pl)
    t = p.totals
    summary = {"src": str(src), "dst": str(dst), "ops": len(p.ops), "kinds": p.kinds(),
               "needed": t.needed, "local": t.local, "host": t.host, "network": t.network,
               "fill": t.fill, "lower_bound": t.lower_bound,
               "lower_bound_network": t.lower_bound_network, "max_sender": t.max_sender,
               "padding": [vars(x) if hasattr(x, "__dict__") else
                           {"path": x.path, "axis": x.axis, "src_padded": x.src_padded,
                            "dst_padded": x.dst_padded, "logical": x.logical} for x in p.padding],
               "matrix": [[s, d, n] for (s, d), n in sorted(p.matrix().items())],
               "placement": [str(d) for d in dst_pl.devices]}
    if args.json:
        print(json.dumps(summary))
        return 0
    where = ("new ranks placed to keep the most bytes in place: " + " ".join(
        f"{r}->{d}" for r, d in enumerate(dst_pl.devices)) if args.best_placement
             else "rank r on the same device before and after")
    print(f"plan {src} -> {dst}: {len(p.ops)} copy ops (hosts of {args.per_host} devices; {where})")
    print(table([[k, size(v)] for k, v in sorted(p.kinds().items())], ["op kind", "bytes"]))
    print(f"kept local      {size(t.local)}")
    print(f"within a host   {size(t.host)}")
    print(f"across hosts    {size(t.network)}   (lower bound {size(t.lower_bound_network)})")
    print(f"moved           {size(t.moved)}   (lower bound {size(t.lower_bound)})")
    print(f"busiest sender  {size(t.max_sender)}")
    for x in p.padding:
        print(f"padding: {x.path} axis {x.axis}: {x.src_padded} -> {x.dst_padded} rows "
              f"(logical {x.logical}; {x.created} created zero-filled, {x.dropped} dropped)")
    print(matrix(p.matrix(), src.world_size, dst.world_size))
    return 0


def verify(args) -> int:
    from tenplex.api import verify as run

    with _scratch() as tmp:
        url, fmt = _as_store(args.path, tmp, args)
        result = run(url)
    print(f"{args.path}: OK ({fmt}): {result['files']} files, {size(result['bytes'])}, "
          f"{result['tensors']} tensors, every checksum verified")
    return 0


def example(args) -> int:
    from tenplex.models import GPTSpec, gpt_tree, random_state
    from tenplex.ptree.shards import materialize
    from tenplex.store.writer import save

    spec = GPTSpec(num_layers=args.layers, hidden=args.hidden, heads=args.heads,
                   query_groups=args.heads,
                   ffn=4 * args.hidden, vocab=50257, seq_len=128, dtype="bfloat16",
                   optimizer="distributed_adam", bucket_numel=1 << 20)
    tree = gpt_tree(spec)
    config = args.config
    state = random_state(tree, config, args.seed)
    sharding = Sharding(tree, config)
    shards = {r: materialize(tree, state, config, r, sharding) for r in range(config.world_size)}
    manifest = save(args.dst, tree, config, shards, meta={"example": {"layers": args.layers,
                                                                     "hidden": args.hidden}})
    stored = sum(f.size for f in manifest.files.values())
    print(f"wrote a GPT-style example ({len(tree)} leaves, {size(stored)}) at {config} to {args.dst}")
    return 0


def demo(args) -> int:
    try:
        from tenplex_megatron.demo import main as run
    except ImportError as exc:
        raise ConfigError("tenplex demo needs the Megatron integration and megatron-core: "
                          "pip install --no-deps megatron-core==0.16.1 && "
                          f"pip install -e integrations/megatron ({exc})") from None
    return run(parsed=args)
