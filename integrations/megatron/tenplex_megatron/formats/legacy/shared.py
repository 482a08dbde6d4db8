"""A Megatron-LM per-rank checkpoint's opened source as JSON, and a source rebuilt from it.

:func:`share_legacy` is run by the process that opened the checkpoint
(:func:`~tenplex_megatron.formats.legacy.read.open_legacy`: every pickle read
through the restricted unpickler, every record checked against the zip's
headers, the tied copies compared); :func:`open_shared_legacy` by the others,
which then read no pickle: each stored tensor arrives as ``[leaf path, tp
rank, pp rank, [file, offset, shape, dtype]]`` and is checked by
:mod:`tenplex_megatron.formats.shared` (inside a rank file of the size process
0 saw, the leaf's local shape and dtype). The RNG states and the Adam steps
arrive as they were unpickled, their tensors as byte ranges: a process reads
those it needs, as one process would.
"""

from __future__ import annotations

from typing import Any

from tenplex.errors import ManifestError
from tenplex.limits import short

from tenplex_megatron.formats.legacy.read import Found, LegacySource
from tenplex_megatron.formats.shared import (check_leaf, decode_refs, description_from, encode_refs, field,
                                             ref_from, ref_json, share_common)

__all__ = ["share_legacy", "open_shared_legacy"]


def share_legacy(source: LegacySource) -> dict:
    """The shared form of an opened legacy source (JSON; see :mod:`tenplex_megatron.formats.shared`)."""
    root = source.meta["megatron"]["root"]
    files = {ref.file for ref in source.refs.values()}
    rng = {k: encode_refs(v, root, files) for k, v in sorted(source.rng_refs.items())}
    steps = [encode_refs(s, root, files) for s in source.steps]
    out = share_common(source, root, files)
    out.update(rng=rng, steps=steps,
               refs=[[path, t, p, ref_json(ref, root)] for (path, t, p), ref in sorted(source.refs.items())])
    return out


def open_shared_legacy(root: str, shared: Any) -> LegacySource:
    """The source :func:`share_legacy` described, for the checkpoint at ``root`` (the same path).

    Raises:
        ManifestError, ConfigError: a malformed form, or one that does not fit the model or the
            files on disk (see :func:`tenplex_megatron.formats.shared.description_from`).
    """
    what = f"{root}: the source description from process 0"
    desc, sizes = description_from(shared, "legacy", root, what)
    config, sharding = desc.config, desc.sharding
    refs = {}
    for item in field(shared, "refs", list, what):
        if not isinstance(item, list) or len(item) != 4 or not isinstance(item[0], str) or \
                type(item[1]) is not int or type(item[2]) is not int:
            raise ManifestError(f"{what}: a tensor is {short(item, 120)}; expected [leaf, tp, pp, tensor]")
        path, t, p, ref = item
        if not (0 <= t < max(config.tp, config.etp) and 0 <= p < config.pp) or (path, t, p) in refs:
            raise ManifestError(f"{what}: {short(path, 120)} at tp={t}, pp={p}: outside the "
                                f"tp={config.tp}, etp={config.etp}, pp={config.pp} grid, or sent twice")
        refs[(path, t, p)] = check_leaf(ref_from(ref, root, sizes, f"{what}: {path}"), sharding, path, t, what)
    rng = decode_refs(field(shared, "rng", dict, what), root, sizes, f"{what}: rng_state")
    steps = decode_refs(field(shared, "steps", list, what), root, sizes, f"{what}: Adam steps")
    return LegacySource(Found(desc, refs, rng, steps, 0))
