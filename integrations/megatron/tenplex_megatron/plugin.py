"""The ``megatron-legacy`` and ``megatron-dist`` formats for the tenplex CLI.

Registered through the ``tenplex.formats`` entry-point group (see
``tenplex/cli/formats.py``): the CLI auto-detects both formats, converts them
into a tenplex store to plan and reshard, and writes the source's format
back unless ``--format`` says otherwise.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tenplex.api import load, save
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.tree import Scope
from tenplex.store.reader import StoreReader

from tenplex_megatron.config import MegatronConfig
from tenplex_megatron.legacy import Loaded, is_legacy, read_legacy, write_legacy

__all__ = ["LEGACY", "DIST", "to_store", "shards_with_values"]


def shards_with_values(loaded: Loaded) -> dict[int, dict[str, Any]]:
    """Each rank's tensor shards plus its value leaves, as :func:`tenplex.save` takes them."""
    out = {}
    for rank, shard in loaded.shards.items():
        full = dict(shard)
        for path, leaf in loaded.tree.values():
            value = loaded.values.get(path)
            full[path] = value if leaf.scope is Scope.GLOBAL else \
                (value or {}).get(leaf.key(loaded.config, rank))
        out[rank] = full
    return out


def to_store(loaded: Loaded, url: str) -> None:
    """Save a loaded Megatron checkpoint as a tenplex store at ``url``."""
    save(url, loaded.tree, loaded.config, shards_with_values(loaded), meta=loaded.meta)


def _model_config(options: dict) -> dict | None:
    """The ``--model-config`` JSON file's fields (a whole config, or overrides of the args)."""
    path = options.get("model_config")
    if not path:
        return None
    with open(path) as f:
        return json.load(f)


def _target_values(reader: StoreReader, config: ParallelConfig) -> dict:
    """The stored values laid out for ``config`` (scoped values by coordinate)."""
    from tenplex.store.execute import target_values
    from tenplex.transform.planner import make_plan
    plan = make_plan(reader.tree, reader.config, config)
    return target_values(reader.tree, plan, reader)


def _padding_report(reader: StoreReader, config: ParallelConfig) -> dict:
    import sys
    from tenplex.ptree.sharding import Sharding
    lines = []
    src, dst = Sharding(reader.tree, reader.config), Sharding(reader.tree, config)
    for path, leaf in reader.tree.tensors():
        pad = leaf.layout.padding
        if pad is not None and src.physical_shape(leaf) != dst.physical_shape(leaf):
            a, b = src.physical_shape(leaf)[pad.axis], dst.physical_shape(leaf)[pad.axis]
            lines.append(f"{path}: axis {pad.axis} padded {a} -> {b} (logical {leaf.shape[pad.axis]}; "
                         f"{max(0, b - a)} rows zero-filled, {max(0, a - b)} dropped)")
    for line in lines:
        print(f"padding: {line}", file=sys.stderr)
    return {"padding": lines}


def _store_parts(url: str):
    reader = StoreReader(url)
    meta = reader.manifest.meta.get("megatron")
    if meta is None:
        from tenplex.errors import ManifestError
        raise ManifestError(f"{url}: not a Megatron model (no megatron config in the manifest meta)")
    cfg = MegatronConfig.from_json(meta["config"])
    return reader, cfg, meta


class _Legacy:
    name = "megatron-legacy"

    @staticmethod
    def detect(path: str) -> bool:
        return os.path.isdir(path) and is_legacy(path)

    @staticmethod
    def to_store(path: str, url: str, **options) -> None:
        to_store(read_legacy(path, _model_config(options)), url)

    @staticmethod
    def from_store(url: str, path: str, to: ParallelConfig | None = None) -> dict:
        reader, cfg, meta = _store_parts(url)
        config = to or reader.config
        tree = reader.tree
        tree.validate(config)
        values = _target_values(reader, config)
        write_legacy(path, lambda rank: load(url, config, rank), cfg, config, values, tree,
                     meta.get("optimizer"))
        return _padding_report(reader, config)


class _Dist:
    name = "megatron-dist"

    @staticmethod
    def detect(path: str) -> bool:
        from tenplex_megatron.dist import is_dist
        return os.path.isdir(path) and is_dist(path)

    @staticmethod
    def to_store(path: str, url: str, **options) -> None:
        from tenplex_megatron.dist import read_dist
        to_store(read_dist(path, _model_config(options)), url)

    @staticmethod
    def reshard(src: str, dst: str, to: ParallelConfig, **options) -> dict | None:
        """Direct dist-to-dist reshard (global tensors stay as they are), or None."""
        from tenplex_megatron.dist import reshard_dist
        return reshard_dist(src, dst, to, _model_config(options))

    @staticmethod
    def from_store(url: str, path: str, to: ParallelConfig | None = None) -> dict:
        from tenplex_megatron.dist import write_dist
        reader, cfg, meta = _store_parts(url)
        config = to or reader.config
        reader.tree.validate(config)
        write_dist(path, url, reader, cfg, meta, config, _target_values(reader, config))
        return _padding_report(reader, config)


LEGACY = _Legacy()
DIST = _Dist()
