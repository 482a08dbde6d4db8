"""Export any Megatron shard source to a Hugging Face model directory, streamed, in bounded memory.

The source (a Megatron checkpoint read in place, or a tenplex store of one)
is planned to tp = pp = ep = 1; the store executor builds each global
tensor from byte-range reads, a few at a time in threads (the target
builder's byte budget). Each tensor is transformed into its HF tensors
(:mod:`~tenplex_megatron.formats.hf.mapping`), which writer threads put
at their offsets in their shard file (:class:`~.stwriter.ShardFile`: the
header is written first, from the shapes) while the next tensors are read;
at most ``budget`` bytes wait to be written. The shard plan (which tensor
goes in which file) is made from the shapes before any read, so the file
names ``model-0000i-of-0000N.safetensors`` are final from the start, and
each file is checked with the ``safetensors`` package once complete. Files are
written into a temporary sibling directory renamed to ``dst`` last. Under
torchrun each process writes its share of the files and one commits
(:mod:`~tenplex_megatron.formats.hf.parts`).
"""

from __future__ import annotations

import gc
import os
import shutil
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from tenplex.errors import AlreadyExistsError, ConfigError, ManifestError
from tenplex.formats.protocol import Part
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.tree import torch_dtype

from tenplex_megatron.formats.hf.catalog import choose
from tenplex_megatron.formats.hf.families.common import common_config
from tenplex_megatron.formats.hf.family import Model
from tenplex_megatron.formats.hf.fields import ModelFields
from tenplex_megatron.formats.hf.mapping import Job, apply, geometry, jobs, segments
from tenplex_megatron.formats.hf.parts import my_files, part_folder, partial_folder, seal, write_meta
from tenplex_megatron.formats.parts import remove_files
from tenplex_megatron.formats.hf.stwriter import ShardFile
from tenplex_megatron.formats.target import BUDGET, TargetBuilder, megatron_meta

__all__ = ["export_hf", "parse_size", "DEFAULT_SHARD", "WEIGHTS_ONLY"]

DEFAULT_SHARD = 5_000_000_000
"""The largest output shard by default (transformers' ``max_shard_size="5GB"``), in bytes."""

WEIGHTS_ONLY = "weights only: optimizer state (Adam moments, steps) is not exported to Hugging Face"

_DTYPES = ("float32", "bfloat16", "float16")


def parse_size(value: int | str | None) -> int:
    """Bytes of ``value``: an int, or ``"500MB"``, ``"5GB"``, ``"2GiB"`` (decimal and binary units).

    Raises:
        ConfigError: an unreadable or non-positive size.
    """
    if value is None:
        return DEFAULT_SHARD
    if isinstance(value, int):
        n = value
    else:
        text = str(value).strip().upper()
        units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
        unit = next((u for u in units if text.endswith(u)), "")
        try:
            n = int(float(text[: len(text) - len(unit)]) * units.get(unit, 1))
        except (ValueError, OverflowError):  # OverflowError: "inf", "1e400GB"
            raise ConfigError(f"--max-shard-size {value!r}: expected bytes or a size like 5GB") from None
    if n <= 0:
        raise ConfigError(f"--max-shard-size {value!r}: must be positive")
    return n


def _shards(work: list[Job], limit: int) -> list[list[Job]]:
    """Jobs grouped into files in order, each file at most ``limit`` bytes unless one job is larger
    (transformers' rule in ``save_pretrained``)."""
    out: list[list[Job]] = [[]]
    size = 0
    for job in work:
        if out[-1] and size + job.nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(job)
        size += job.nbytes
    return out


def _config_json(model: Model, family, dtype: str) -> dict:
    out = {"architectures": [family.architecture], "model_type": family.name, **common_config(model)}
    out.update({k: fn(model) for k, fn in family.config.items()})
    out["dtype"] = dtype
    return out


def export_hf(source, dst: str, *, hf_arch: str | None = None, dtype: str | None = None,
              max_shard_size: int | str | None = None, threads: int = 8,
              progress: Callable[[int, int], None] | None = None, budget: int | None = None,
              part: Part | None = None) -> dict:
    """Write ``source`` as a Hugging Face model directory at ``dst``.

    Args:
        source: a Megatron shard source (legacy, torch_dist, or a tenplex store of one).
        dst: a directory that does not exist yet (or is empty).
        hf_arch: a family name (``--hf-arch``); None infers it from the checkpoint.
        dtype: ``float32``, ``bfloat16`` or ``float16``; None keeps the parameters' dtype.
            ``float32`` from a checkpoint with fp32 main params exports those.
        max_shard_size: the largest output file (bytes or ``"5GB"``), default 5 GB.
        threads: stored tensors read at once, at most the CPUs this process may run on
            (:func:`_cpus`).
        progress: ``progress(done_bytes, total_bytes)`` of global tensors built.
        budget: bytes of global tensors built ahead, and of tensors waiting to be written, at once;
            default a quarter of the largest output shard, within [64 MiB, 512 MiB] (the process
            then holds about twice that beyond the tensor in hand, inside the memory bound
            ``1.5 x (largest source file + largest output shard)``).
        part: a :class:`~tenplex.formats.protocol.Part`: write only this part's shard files
            (split by bytes, :mod:`~tenplex_megatron.formats.hf.parts`) into the run's temporary
            folder, fsync them and commit nothing; ``progress`` then counts this part's bytes
            against the whole export's.

    Returns:
        ``{"bytes_written", "bytes_needed", "files", "family", "padding": [], "notes"}``, and with
        ``part`` also ``"part"``: ``{"files": {name: [size, xxh3-128]}, "expected": [every shard
        file], "ranks": [indices of this part's files], "bytes_written"}``, part 0's with the
        ``"index"`` and ``"config"`` the commit writes.

    Raises:
        ConfigError: a feature no family expresses, an unknown family or dtype.
        AlreadyExistsError: ``dst`` exists and is not an empty directory.
        ManifestError: the source is not a Megatron model.
    """
    cfg, _ = megatron_meta(source)
    args = source.value("megatron/args", "")
    fields = ModelFields.from_args(args)
    family = choose(cfg, fields, hf_arch)
    out_dtype = dtype or cfg.params_dtype
    if out_dtype not in _DTYPES:
        raise ConfigError(f"--dtype {dtype}: expected one of {', '.join(_DTYPES)}")
    main = out_dtype == "float32" and cfg.params_dtype != "float32" and any(
        p.startswith("optimizer/param/") for p, _ in source.tree.tensors())
    tdtype = torch_dtype(out_dtype)
    work = jobs(source.tree, cfg, family, tdtype.itemsize, main_params=main)
    files = _shards(work, parse_size(max_shard_size))
    if budget is None:
        largest = max(sum(j.nbytes for j in shard) for shard in files)
        budget = min(max(BUDGET, largest // 4), 8 * BUDGET)
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise AlreadyExistsError(f"{dst}: exists and is not an empty directory; the export writes a new one")
    notes = [WEIGHTS_ONLY, f"family {family.name} ({family.architecture})"]
    if not fields.in_args:
        notes.append("the checkpoint carries no Megatron args: norm epsilon, rope and router settings are "
                     "megatron-core's defaults")
    if main:
        notes.append("float32 weights are the optimizer's fp32 main params")
    if cfg.vocab_padded_from:
        notes.append(f"vocab_size {cfg.vocab_size}: the padded vocabulary (the args give no tokenizer size); "
                     "give the tokenizer's size N with --model-config (a JSON file: {\"vocab_size\": N}) "
                     "to export N rows")
    names = [_name(i, len(files)) for i in range(len(files))]
    weight_map = {n: names[i] for i, shard in enumerate(files) for j in shard for n in j.names}
    index = {"metadata": {"total_size": sum(j.nbytes for j in work)}, "weight_map": dict(sorted(weight_map.items()))}
    config = _config_json(Model(cfg, fields), family, out_dtype)
    mine = list(range(len(files))) if part is None else my_files(
        [sum(j.nbytes for j in shard) for shard in files], part)
    if part is None:
        tmp = partial_folder(dst, str(os.getpid()))
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    else:
        tmp = part_folder(dst, part.token)
    collecting = gc.isenabled()
    gc.disable()  # a full collection walks every object torch made, holding the GIL the readers need
    try:
        sizes, needed = _write(source, files, names, mine, geometry(cfg, fields), tdtype, tmp,
                               max(1, min(threads, _cpus())), progress,
                               budget)
        if part is None:
            write_meta(tmp, index, config)
            if os.path.isdir(dst):
                os.rmdir(dst)
            os.rename(tmp, dst)
        else:
            report = {"files": seal(tmp, [names[i] for i in mine]), "expected": names, "ranks": mine,
                      "bytes_written": sum(sizes.values())}
            if part.index == 0:
                report.update(index=index, config=config)
    except BaseException:
        if part is None:
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # the other parts' files are theirs (or the committer's) to remove
            remove_files(tmp, [names[i] for i in mine])
        raise
    finally:
        if collecting:
            gc.enable()
    return {"bytes_written": sum(sizes.values()), "bytes_needed": needed, "files": len(mine),
            "family": family.name, "padding": [], "notes": notes, **({"part": report} if part else {})}


def _cpus() -> int:
    """The CPUs this process may run on. The reads copy from the page cache and the transforms are
    CPU work: more threads than CPUs only contend (2 CPUs, in-process export of 2 GB, 8 threads
    against 2, alternating: 15.9, 6.5, 4.8 s against 6.1, 5.6, 3.8 s, the same CPU seconds)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _write(source, files, names, mine, geo, dtype, tmp, threads, progress, budget) -> tuple[dict[str, int], int]:
    """Write every shard file. Jobs (read, transform) run in threads, at most ``budget`` bytes of
    them at once, in file order; this thread writes each job's tensors as it completes, in file
    order, so every file is written front to back (on ext4, writing the same bytes into a
    pre-sized file, or out of order, took 3 to 10 times the kernel time of appending them), and
    closes (and checks) a file after its last job. Only the files ``mine`` (indices of ``files``,
    named ``names``) are written. ``({file: bytes}, source bytes needed)``."""
    sizes = {}
    left = [len(shard) for shard in files]
    open_files: dict[int, ShardFile] = {}
    pending: deque = deque()
    held = [0]
    count = _Progress(progress, sum(job.nbytes for shard in files for job in shard))

    def settle(limit: int) -> None:  # write the oldest jobs until at most ``limit`` bytes are in flight
        while pending and (held[0] > limit or pending[0][2].done()):
            nbytes, i, future = pending.popleft()
            f = open_files[i]
            for name, start, data in future.result():
                f.write_range(name, start, data)
            held[0] -= nbytes
            count(nbytes)
            left[i] -= 1
            if left[i] == 0:
                f.close()
                sizes[os.path.basename(f.path)] = f.size

    try:
        with TargetBuilder(source, ParallelConfig(), threads=threads, budget=budget) as b, \
                ThreadPoolExecutor(max(1, threads)) as pool:  # its exit waits for every job
            for i in mine:
                shard = files[i]
                open_files[i] = ShardFile(os.path.join(tmp, names[i]), [
                    (n, dtype, s) for j in shard for n, s in zip(j.names, j.shapes)], {"format": "pt"})
                for job in shard:
                    nbytes = max(job.nbytes, b.runner.D.holding(job.path, _ORIGIN).numel * b.tree[job.path].itemsize)
                    settle(budget - nbytes)
                    pending.append((nbytes, i, pool.submit(_job, b, job, open_files[i], geo, dtype)))
                    held[0] += nbytes
            settle(-1)
            needed = b.runner.bytes_needed
    finally:
        for f in open_files.values():
            if f.fd is not None:
                os.close(f.fd)
                f.fd = None
    return sizes, needed


_ORIGIN = ParallelConfig().coord(0)


class _Progress:
    """``progress(done, total)`` of bytes of jobs written."""

    def __init__(self, fn: Callable[[int, int], None] | None, total: int):
        self.fn, self.total, self.done = fn, total, 0

    def __call__(self, nbytes: int) -> None:
        if self.fn:
            self.done += nbytes
            self.fn(min(self.done, self.total), self.total)


def _job(b: TargetBuilder, job: Job, f: ShardFile, geo, dtype) -> list[tuple[str, int, torch.Tensor]]:
    """Read ``job``'s global tensor; its HF tensors as ``[(name, first element, flat contiguous
    elements)]`` in ``f``'s byte order: views of the read buffers where the transform moves rows
    unchanged (:func:`~.mapping.segments`), else :func:`~.mapping.apply`'s tensors."""
    shape = tuple(b.runner.D.holding(job.path, _ORIGIN).shape)
    got = b.runner.leaf(job.path, [0]).get(0)
    if got is None:
        raise ManifestError(f"export: the source holds no part of {job.path}")
    parts = [p.contiguous().reshape(-1) for p in (got if isinstance(got, (list, tuple)) else [got])]
    del got
    runs = segments(job, shape, geo, parts[0].dtype == dtype)
    if runs is None:
        whole = parts[0] if len(parts) == 1 else torch.cat(parts)
        del parts
        return [(name, 0, t.reshape(-1)) for name, t in apply(job, whole.view(shape), geo, dtype).items()]
    out, position = [], 0
    for part in parts:
        end = position + part.numel()
        for start, n, name, at in runs:
            lo, hi = max(position, start), min(end, start + n)
            if lo < hi:
                out.append((name, at + lo - start, part[lo - position: hi - position]))
        position = end
    return sorted(out, key=lambda piece: f.slots[piece[0]][0] + piece[1] * piece[2].element_size())
