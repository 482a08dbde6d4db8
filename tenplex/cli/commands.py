"""The CLI's commands; each takes parsed arguments and returns an exit code.

Checkpoints of plugin formats are read in place: ``inspect`` and ``plan``
read their metadata only (``describe``), ``reshard`` reads them through the
plugin's shard source by byte ranges, and ``verify`` checks their files on
disk. Nothing is converted into an intermediate store.
"""

from __future__ import annotations

import json
import sys
import time
from math import prod

from tqdm import tqdm

from tenplex.cli.formats import TENPLEX, detect, formats
from tenplex.cli.render import matrix, size, table
from tenplex.errors import ConfigError
from tenplex.ptree.sharding import Sharding
from tenplex.store.reader import StoreReader
from tenplex.transform.placement import Placement
from tenplex.transform.planner import make_plan

__all__ = ["reshard", "inspect", "plan", "verify", "example"]


def _options(args) -> dict:
    return {"model_config": getattr(args, "model_config", None), "threads": getattr(args, "threads", 8)}


class _Bar:
    """A tqdm byte progress bar fed with ``(done_bytes, total_bytes)``."""

    def __init__(self, desc: str):
        self.bar = tqdm(total=0, unit="B", unit_scale=True, desc=desc, disable=None, file=sys.stderr)

    def __call__(self, done: int, total: int) -> None:
        self.bar.total = total
        self.bar.n = done
        self.bar.refresh()

    def __enter__(self) -> "_Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


def _describe(path: str, args):
    """``(format, tree, config, values, meta, files)`` from metadata only; ``files`` is
    ``(count, stored bytes)`` for a tenplex store, else None."""
    fmt = detect(path)
    if fmt == TENPLEX:
        reader = StoreReader(path)
        m = reader.manifest
        return fmt, reader.tree, reader.config, m.values, m.meta, (
            len(m.files), sum(f.size for f in m.files.values()))
    d = formats()[fmt].describe(path, **_options(args))
    return fmt, d.tree, d.config, d.values, d.meta, None


def _open(path: str, args):
    fmt = detect(path)
    if fmt == TENPLEX:
        return fmt, StoreReader(path)
    return fmt, formats()[fmt].open_source(path, **_options(args))


def _report(args, summary: dict, padding, notes) -> None:
    """Print a reshard's padding changes and notes (stderr) and its summary (stdout)."""
    lines = [str(c) for c in padding]  # PaddingChange, or plugins' own lines
    for line in lines:
        print(f"padding: {line}", file=sys.stderr)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps({**summary, "padding": lines, "notes": list(notes)}))
        return
    gbps = (summary.get("bytes_read", 0) + summary.get("bytes_written", 0)) / max(summary["seconds"], 1e-9) / 1e9
    formats_ = "" if summary["src_format"] == summary["format"] == TENPLEX else \
        f" ({summary['src_format']} -> {summary['format']}{', items copied directly' if summary.get('direct') else ''})"
    needed = f" (needed {size(summary['bytes_needed'])})" if "bytes_needed" in summary else ""
    print(f"resharded {summary['src']} -> {summary['dst']}{formats_}: read {size(summary.get('bytes_read', 0))}"
          f"{needed}, wrote {size(summary.get('bytes_written', 0))} in {summary['seconds']:.2f} s "
          f"({gbps:.2f} GB/s)")


def reshard(args) -> int:
    from tenplex.api import reshard as store_reshard
    from tenplex.cli.convert import write_store

    start = time.perf_counter()
    plugins = formats()
    src_fmt = detect(args.src)
    out_fmt = args.format or src_fmt
    if out_fmt != TENPLEX and out_fmt not in plugins:
        raise ConfigError(f"--format {out_fmt}: unknown; expected one of "
                          f"{', '.join([TENPLEX] + sorted(plugins))}")
    base = {"dst": str(args.to), "src_format": src_fmt, "format": out_fmt}
    direct = getattr(plugins.get(src_fmt), "reshard", None)
    if direct is not None and out_fmt == src_fmt:
        report = direct(args.src, args.dst, args.to, **_options(args))
        if report is not None:
            summary = {**base, "seconds": time.perf_counter() - start,
                       **{k: v for k, v in report.items() if k not in ("padding", "notes")}}
            _report(args, summary, report.get("padding", []), report.get("notes", []))
            return 0
    if src_fmt == TENPLEX and out_fmt == TENPLEX:
        with _Bar("reshard") as bar:
            r = store_reshard(args.src, args.dst, args.to, threads=args.threads, progress=bar)
        summary = {**base, "src": str(r.src), "bytes_read": r.bytes_read, "bytes_needed": r.bytes_needed,
                   "bytes_written": r.bytes_written, "seconds": r.seconds}
        _report(args, summary, r.padding, [])
        return 0
    _, source = _open(args.src, args)
    if out_fmt == TENPLEX:
        with _Bar("reshard") as bar:
            report = write_store(source, args.dst, args.to, threads=args.threads, progress=bar)
    else:
        with _Bar("reshard") as bar:
            report = plugins[out_fmt].write(source, args.dst, args.to, **_options(args), progress=bar)
    summary = {**base, "src": str(source.config), "bytes_read": source.bytes_read,
               "bytes_written": report["bytes_written"], "seconds": time.perf_counter() - start}
    _report(args, summary, report.get("padding", []), report.get("notes", []))
    return 0


def inspect(args) -> int:
    fmt, tree, config, values, meta, files = _describe(args.path, args)
    sharding = Sharding(tree, config)
    rows, total = [], 0
    for path, leaf in tree.leaves.items():
        if hasattr(leaf, "shape"):
            n = prod(leaf.shape) * leaf.itemsize
            total += n
            rows.append({"path": path, "shape": list(leaf.shape), "dtype": leaf.dtype,
                         "layout": str(leaf.layout), "bytes": n,
                         "ranks": len(sharding.ranks_holding(path))})
        else:
            rows.append({"path": path, "value": values.get(path), "scope": leaf.scope.value})
    if args.json:
        out = {"format": fmt, "config": config.to_json(), "num_layers": tree.num_layers,
               "leaves": rows, "logical_bytes": total, "meta": meta}
        if files is not None:
            out.update(files=files[0], stored_bytes=files[1])
        print(json.dumps(out))
        return 0
    print(f"{args.path}: {fmt} checkpoint, config {config}, {tree.num_layers} layers")
    print(table([[r["path"], "x".join(map(str, r["shape"])), r["dtype"], r["layout"], size(r["bytes"])]
                 for r in rows if "shape" in r], ["path", "shape", "dtype", "layout", "size"]))
    shown = [r for r in rows if "shape" not in r]
    if shown:
        print(table([[r["path"], r["scope"], json.dumps(r["value"])[:60]] for r in shown],
                    ["value", "scope", "content"]))
    stored = f", {size(files[1])} stored in {files[0]} files" if files is not None else ""
    print(f"total: {len(rows)} leaves, {size(total)} logical{stored}")
    return 0


def plan(args) -> int:
    _, tree, src, _, _, _ = _describe(args.path, args)
    dst = args.to
    src_pl = Placement.contiguous(src.world_size, args.per_host)
    dst_pl = Placement.contiguous(dst.world_size, args.per_host)
    if args.best_placement:
        from tenplex.transform.assign import best_placement
        pool = list(Placement.contiguous(max(src.world_size, dst.world_size), args.per_host).devices)
        dst_pl = best_placement(tree, src, dst, src_pl, pool)
    p = make_plan(tree, src, dst, src_placement=src_pl, dst_placement=dst_pl)
    t = p.totals
    summary = {"src": str(src), "dst": str(dst), "ops": len(p.ops), "kinds": p.kinds(),
               "needed": t.needed, "local": t.local, "host": t.host, "network": t.network,
               "fill": t.fill, "lower_bound": t.lower_bound,
               "lower_bound_network": t.lower_bound_network, "max_sender": t.max_sender,
               "padding": [{"path": x.path, "axis": x.axis, "src_padded": x.src_padded,
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
        print(f"padding: {x}")
    print(matrix(p.matrix(), src.world_size, dst.world_size))
    return 0


def verify(args) -> int:
    fmt = detect(args.path)
    if fmt == TENPLEX:
        from tenplex.api import verify as run

        result = run(args.path)
        print(f"{args.path}: OK ({fmt}): {result['files']} files, {size(result['bytes'])}, "
              f"{result['tensors']} tensors, every checksum verified")
        return 0
    with _Bar("verify") as bar:
        result = formats()[fmt].verify(args.path, **_options(args), checksums=args.checksums, progress=bar)
    for name, digest in sorted((result.get("checksums") or {}).items()):
        print(f"xxh3-128 {digest}  {name}")
    print(f"{args.path}: OK ({fmt}): {result['files']} files, {size(result['bytes'])}, "
          f"{result['tensors']} tensors, every record's CRC-32 verified on disk")
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
