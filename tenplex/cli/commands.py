"""The CLI's commands; each takes parsed arguments and returns an exit code.

Checkpoints of plugin formats are read in place: ``inspect`` and ``plan``
read their metadata only (``describe``), ``reshard`` reads them through the
plugin's shard source by byte ranges, and ``verify`` checks their files on
disk. Nothing is converted into an intermediate store.
"""

from __future__ import annotations

import json
from dataclasses import asdict
import sys
from math import prod

from tqdm import tqdm

from tenplex import api
from tenplex.api import ReshardReport
from tenplex.cli.render import matrix, size, table
from tenplex.errors import ConfigError
from tenplex.formats import Description, detect, get_format
from tenplex.ptree.sharding import Sharding
from tenplex.transform.placement import Placement
from tenplex.transform.planner import make_plan

__all__ = ["reshard", "inspect", "plan", "verify", "example"]


def _options(args) -> dict:
    """The format options (see :mod:`tenplex.formats.protocol`) the command line gave."""
    out = {"model_config": getattr(args, "model_config", None), "threads": getattr(args, "threads", 8),
           "iteration": getattr(args, "iteration", None)}
    for name in ("names", "hf_arch", "dtype", "max_shard_size"):  # format-specific options, where given
        if getattr(args, name, None):
            out[name] = getattr(args, name)
    return out


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


def _describe(path: str, args) -> Description:
    return detect(path).describe(path, **_options(args))


def _report(args, r: ReshardReport) -> None:
    """Print a reshard's padding changes and notes (stderr) and its summary (stdout)."""
    for line in r.padding:
        print(f"padding: {line}", file=sys.stderr)
    for note in r.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        out = {k: v for k, v in asdict(r).items() if k not in ("src", "dst")}
        print(json.dumps({**out, "src": args.src if r.src is None else str(r.src), "dst": str(r.dst),
                          "padding": list(r.padding), "notes": list(r.notes)}))
        return
    print(r.summary().replace("resharded -> ", f"resharded {args.src} -> ", 1))


def reshard(args) -> int:
    if args.to is None:  # a format with one layout (hf: tp = pp = ep = 1) needs no --to
        args.to = getattr(get_format(args.format), "fixed_config", None) if args.format else None
        if args.to is None:
            raise ConfigError("--to is required (the target config), except for a format with one "
                              "layout (such as hf)")
    from tenplex.distributed_reshard import under_torchrun
    if under_torchrun():  # one process of a torchrun (or Slurm) job: split the files, one commit
        from tenplex.cli.torchrun import reshard_torchrun
        return reshard_torchrun(args, _options(args), _Bar)
    with _Bar("reshard") as bar:
        r = api.reshard(args.src, args.dst, args.to, format=args.format, progress=bar, **_options(args))
    _report(args, r)
    return 0


def inspect(args) -> int:
    d = _describe(args.path, args)
    fmt, tree, config, values, meta = d.format, d.tree, d.config, d.values, d.meta
    files = None if d.files is None else (d.files, d.stored_bytes)
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
    d = _describe(args.path, args)
    tree, src = d.tree, d.config
    dst = args.to
    src_pl = Placement.contiguous(src.world_size, args.per_host)
    dst_pl = Placement.contiguous(dst.world_size, args.per_host)
    if args.best_placement:
        from tenplex.transform.assign import best_placement
        pool = list(Placement.contiguous(max(src.world_size, dst.world_size), args.per_host).devices)
        dst_pl = best_placement(tree, src, dst, src_pl, pool)
    p = make_plan(tree, src, dst, src_placement=src_pl, dst_placement=dst_pl, bound=True)
    t = p.totals
    summary = {"src": str(src), "dst": str(dst), "ops": len(p.ops), "kinds": p.kinds(),
               "needed": t.needed, "local": t.local, "host": t.host, "network": t.network,
               "fill": t.fill, "lower_bound": t.lower_bound,
               "lower_bound_network": t.lower_bound_network, "max_sender": t.max_sender,
               "moved": t.moved, "placement_bound": t.placement_bound,
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
    print(f"moved           {size(t.moved)}   (lower bound {size(t.lower_bound)}; "
          f"any placement {size(t.placement_bound)})")
    print(f"busiest sender  {size(t.max_sender)}")
    for x in p.padding:
        print(f"padding: {x}")
    print(matrix(p.matrix(), src.world_size, dst.world_size))
    return 0


def verify(args) -> int:
    fmt = detect(args.path)
    with _Bar("verify") as bar:
        r = fmt.verify(args.path, **_options(args), checksums=args.checksums, progress=bar)
    for name, digest in sorted((r.checksums or {}).items()):
        print(f"xxh3-128 {digest}  {name}")
    print(f"{args.path}: OK ({fmt.name}): {r.files} files, {size(r.bytes)}, {r.tensors} tensors, "
          f"{r.checked} verified")
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
