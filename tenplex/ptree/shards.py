"""Materialize a rank's local shards from global state, and assemble them back.

*Global state* maps each leaf path to:

- a tensor of the leaf's logical global shape and dtype (tensor leaves);
- the value (``Scope.GLOBAL`` value leaves);
- ``{key: value}`` (``Scope.RANK`` and ``Scope.COORD``), keys as given by
  :meth:`ValueLeaf.key`, e.g. ``"tp=1,pp=0"``.

*Local shards* of one rank map each leaf path the rank holds to its local
tensor (see :mod:`tenplex.ptree.sharding`) or value.
"""

from __future__ import annotations

from math import prod
from typing import Any, Mapping

import torch

from tenplex.errors import ReplicaMismatchError, ShardError
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.region import Box, intersect, relative, to_slices
from tenplex.ptree.sharding import Holding, Piece, Sharding
from tenplex.ptree.tree import PTree, Scope, TensorLeaf, ValueLeaf, torch_dtype

__all__ = ["materialize", "assemble", "piece_view", "check_shard", "bitwise_equal"]

Shards = dict[str, Any]


def piece_view(local: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The view of ``local`` that holds ``piece.box`` of the global tensor.

    Writes through the view land in ``local`` (``local`` must be contiguous).
    """
    n = prod(piece.view)
    return local.view(-1)[piece.offset: piece.offset + n].view(piece.view)[to_slices(piece.local)]


def check_shard(path: str, leaf: TensorLeaf, held: Holding, tensor: Any, rank: int) -> None:
    """Raise ShardError unless ``tensor`` is a contiguous tensor of the expected shape and dtype."""
    if not isinstance(tensor, torch.Tensor):
        raise ShardError(f"rank {rank}, leaf {path}: expected a tensor, found {type(tensor).__name__}")
    if tensor.dtype != torch_dtype(leaf.dtype):
        raise ShardError(f"rank {rank}, leaf {path}: expected dtype {leaf.dtype}, "
                         f"found {str(tensor.dtype).removeprefix('torch.')}")
    if tuple(tensor.shape) != held.shape:
        raise ShardError(f"rank {rank}, leaf {path}: expected local shape {list(held.shape)}, "
                         f"found {list(tensor.shape)}")
    if not tensor.is_contiguous():
        raise ShardError(f"rank {rank}, leaf {path}: local shard must be contiguous")


def materialize(tree: PTree, state: Mapping[str, Any], config: ParallelConfig, rank: int,
                sharding: Sharding | None = None) -> Shards:
    """The local shards of ``rank`` under ``config``.

    A tensor in ``state`` has the leaf's logical shape (padding elements are
    then zero-filled) or its padded shape under ``config`` (padding elements
    are taken from it).

    Args:
        tree: the tree spec.
        state: global state (see the module docstring).
        config: the parallel config.
        rank: the rank, ``0 <= rank < config.world_size``.
        sharding: a precomputed :class:`Sharding` of ``tree`` under ``config``.

    Returns:
        ``{path: local tensor or value}`` for every leaf the rank holds.

    Raises:
        ConfigError: if ``config`` cannot hold ``tree``.
        ShardError: if ``state`` lacks a leaf or a tensor has the wrong shape or dtype.
    """
    sharding = sharding or Sharding(tree, config)
    coord = config.coord(rank)
    out: Shards = {}
    for path, leaf in tree.leaves.items():
        if path not in state:
            raise ShardError(f"global state: leaf {path} is missing")
        if isinstance(leaf, ValueLeaf):
            out[path] = _value_for(path, leaf, state[path], config, rank)
            continue
        tensor = state[path]
        _check_global(path, leaf, tensor, sharding.physical_shape(leaf))
        held = sharding.holding(path, coord)
        if held is None:
            continue
        logical = Box((0,) * len(leaf.shape), tuple(tensor.shape))
        covered = all(intersect(p.box, logical) == p.box for p in held.pieces)
        local = (torch.empty if covered else torch.zeros)(held.shape, dtype=tensor.dtype)
        for piece in held.pieces:
            inside = intersect(piece.box, logical)
            if inside is not None:
                view = piece_view(local, piece)
                view[to_slices(relative(inside, piece.box))] = tensor[to_slices(inside)]
        out[path] = local
    return out


def _check_global(path: str, leaf: TensorLeaf, tensor: Any, padded: tuple = ()) -> None:
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) not in (leaf.shape, padded) \
            or tensor.dtype != torch_dtype(leaf.dtype):
        found = (f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
                 if isinstance(tensor, torch.Tensor) else type(tensor).__name__)
        raise ShardError(f"global state, leaf {path}: expected {list(leaf.shape)} {leaf.dtype}, "
                         f"found {found}")


def _value_for(path: str, leaf: ValueLeaf, value: Any, config: ParallelConfig, rank: int) -> Any:
    if leaf.scope is Scope.GLOBAL:
        return value
    if not isinstance(value, Mapping):
        raise ShardError(f"global state, leaf {path}: expected {{key: value}} for scope "
                         f"{leaf.scope.value}, found {type(value).__name__}")
    return value.get(leaf.key(config, rank))


def assemble(tree: PTree, config: ParallelConfig, shards_by_rank: Mapping[int, Shards],
             sharding: Sharding | None = None, padded: bool = False,
             check_replicas: bool = True) -> dict[str, Any]:
    """Global state from every rank's local shards (logical rows only, unless ``padded``).

    Replicas are compared bit for bit wherever they overlap.

    Args:
        tree: the tree spec.
        config: the config the shards are laid out for.
        shards_by_rank: ``{rank: local shards}`` for every rank of ``config``.
        sharding: a precomputed :class:`Sharding` of ``tree`` under ``config``.
        padded: return tensors with their padded shapes under ``config``
            (padding elements as the shards hold them).
        check_replicas: compare replicas bit for bit and check coverage
            element by element. ``False`` copies each holder class once
            (from its lowest rank) into an uninitialized result; for writers
            that trust their shards, it is several times faster.

    Returns:
        Global state: logical (or padded) tensors and values.

    Raises:
        ShardError: if a rank or a leaf is missing, a shard has the wrong
            shape or dtype, or some logical element is held by no rank.
        ReplicaMismatchError: if two ranks hold different bytes for the same
            element, naming the leaf and both ranks.
    """
    sharding = sharding or Sharding(tree, config)
    missing = sorted(set(range(config.world_size)) - set(shards_by_rank))
    if missing:
        raise ShardError(f"assemble under {config}: shards of ranks {missing} are missing")
    out: dict[str, Any] = {}
    for path, leaf in tree.leaves.items():
        if isinstance(leaf, ValueLeaf):
            out[path] = _assemble_value(path, leaf, config, shards_by_rank)
        else:
            shape = sharding.physical_shape(leaf) if padded else leaf.shape
            build = _assemble_tensor if check_replicas else _assemble_fast
            out[path] = build(path, leaf, sharding, shards_by_rank, shape)
    return out


def _held_regions(path, leaf, sharding, shards_by_rank, shape, every_replica: bool):
    """``(rank, box, source view)`` for every held region inside ``shape``, checking each shard.

    With ``every_replica`` False, only each holder class's lowest rank is visited.
    """
    extent = Box((0,) * len(shape), tuple(shape))
    for holders in sharding.classes(path):
        for rank in holders.ranks if every_replica else holders.ranks[:1]:
            local = shards_by_rank[rank].get(path)
            if local is None:
                raise ShardError(f"rank {rank}: leaf {path} is missing from its shards")
            check_shard(path, leaf, holders.holding, local, rank)
            for piece in holders.holding.pieces:
                inside = intersect(piece.box, extent)
                if inside is not None:
                    yield rank, inside, piece_view(local, piece)[to_slices(relative(inside, piece.box))]


def _assemble_tensor(path, leaf, sharding, shards_by_rank, shape) -> torch.Tensor:
    """Every replica merged, compared bit for bit, and coverage checked element by element."""
    result = torch.zeros(shape, dtype=torch_dtype(leaf.dtype))
    written = torch.zeros(shape, dtype=torch.int16)
    first_writer = torch.full(shape, -1, dtype=torch.int32)
    for rank, box, src in _held_regions(path, leaf, sharding, shards_by_rank, shape, True):
        _merge(path, rank, result, written, first_writer, box, src)
    if not bool(written.all()):
        raise ShardError(f"assemble: leaf {path} has {int((written == 0).sum())} elements "
                         "that no rank holds")
    return result


def _assemble_fast(path, leaf, sharding, shards_by_rank, shape) -> torch.Tensor:
    """Each holder class's pieces copied once; the classes cover the tensor by construction."""
    result = torch.empty(shape, dtype=torch_dtype(leaf.dtype))
    for _, box, src in _held_regions(path, leaf, sharding, shards_by_rank, shape, False):
        result[to_slices(box)] = src
    return result


def _merge(path, rank, result, written, first_writer, box, src) -> None:
    sl = to_slices(box)
    dst, seen, who = result[sl], written[sl], first_writer[sl]
    mask = seen > 0
    if bool(mask.any()):
        differ = mask & ~bitwise_equal(dst, src, elementwise=True)
        if bool(differ.any()):
            other = int(who[differ].flatten()[0])
            raise ReplicaMismatchError(
                f"leaf {path}: replicas on ranks {other} and {rank} differ in "
                f"{int(differ.sum())} elements of region {box}")
    dst.copy_(src)
    who[~mask] = rank
    seen += 1


def bitwise_equal(a: torch.Tensor, b: torch.Tensor, elementwise: bool = False):
    """Bit-for-bit equality (NaNs with equal bits are equal, ``-0.0 != 0.0``)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False if not elementwise else torch.zeros(a.shape, dtype=torch.bool)
    if a.dtype.is_floating_point:
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.contiguous().view(as_int), b.contiguous().view(as_int)
    eq = a == b
    return eq if elementwise else bool(eq.all())


def _assemble_value(path, leaf, config, shards_by_rank):
    values: dict[str, Any] = {}
    owner: dict[str, int] = {}
    for rank in range(config.world_size):
        shards = shards_by_rank[rank]
        if path not in shards:
            raise ShardError(f"rank {rank}: value leaf {path} is missing from its shards")
        key = leaf.key(config, rank)
        if key in values and values[key] != shards[path]:
            raise ReplicaMismatchError(f"value leaf {path}[{key or 'global'}]: ranks {owner[key]} "
                                       f"and {rank} hold {values[key]!r} and {shards[path]!r}")
        values.setdefault(key, shards[path])
        owner.setdefault(key, rank)
    return values[""] if leaf.scope is Scope.GLOBAL else values
