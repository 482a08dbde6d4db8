"""Shared helpers of the store tests: states, comparisons, raw edits of stored files."""

from __future__ import annotations

import functools
import json
from typing import Any, Callable

import fsspec
import torch

from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig, PTree, materialize
from tenplex.ptree.shards import bitwise_equal

SPEC = GPTSpec(num_layers=2, hidden=128, heads=8, query_groups=4, ffn=512, vocab=4000, swiglu=True,
               tied=True, dtype="bfloat16", optimizer="distributed_adam", bucket_numel=300_000,
               make_vocab_size_divisible_by=8)
"""A GPT tree of about 14 MB (bf16 params, fp32 distributed Adam); its largest tensors
(the embedding's optimizer state, 2 MB each) span thousands of small checksum blocks."""

SRC = ParallelConfig(dp=1, tp=2, pp=1)
"""The config the suite saves under: whole-tensor dp shards of 1 MB and more."""


@functools.lru_cache(maxsize=4)
def state_of(spec: GPTSpec, config: ParallelConfig, seed: int):
    """``(tree, global state, {rank: local shards})`` (cached: treat as read-only)."""
    tree = gpt_tree(spec)
    st = random_state(tree, config, seed)
    return tree, st, {r: materialize(tree, st, config, r) for r in range(config.world_size)}


def assert_same_shards(expected: dict[str, Any], got: dict[str, Any], where: str = "") -> None:
    """Same leaves; tensors equal bit for bit (dtype and shape included); values equal."""
    assert set(got) == set(expected), f"{where}: leaves differ: {set(got) ^ set(expected)}"
    for path, want in expected.items():
        if isinstance(want, torch.Tensor):
            assert isinstance(got[path], torch.Tensor), f"{where}: {path} is not a tensor"
            assert bitwise_equal(want, got[path]), f"{where}: {path} differs"
        else:
            assert got[path] == want, f"{where}: value {path}: {got[path]!r} != {want!r}"


def assert_same_global(tree: PTree, expected: dict[str, Any], got: dict[str, Any]) -> None:
    """Every tensor leaf of ``got`` equals ``expected`` bit for bit (logical shapes)."""
    for path, _ in tree.tensors():
        assert path in got, f"{path} missing"
        assert bitwise_equal(expected[path], got[path]), path


def assert_rank_loads(url: str, tree: PTree, st: dict, target: ParallelConfig,
                      values: bool = True) -> None:
    """``load(url, target, r) == materialize(st, target, r)`` bit for bit, for every rank.

    With ``values=False`` only tensor leaves are compared (scoped values of
    keys the store's config lacks are not stored).
    """
    from tenplex.api import load
    for rank in range(target.world_size):
        want, got = materialize(tree, st, target, rank), load(url, target, rank)
        if not values:
            want = {p: v for p, v in want.items() if isinstance(v, torch.Tensor)}
            got = {p: v for p, v in got.items() if isinstance(v, torch.Tensor)}
        assert_same_shards(want, got, f"{url} rank {rank} of {target}")


def fs_path(url: str):
    """``(filesystem, path)`` of an fsspec URL."""
    return fsspec.core.url_to_fs(url)


def read_bytes(url: str) -> bytes:
    fs, path = fs_path(url)
    return fs.cat_file(path)


def write_bytes(url: str, data: bytes) -> None:
    fs, path = fs_path(url)
    with fs.open(path, "wb") as f:
        f.write(data)


def corrupt(url: str, key: str, fn: Callable[[bytes], bytes]) -> None:
    """Replace the file ``key`` under ``url`` with ``fn(its bytes)``."""
    write_bytes(f"{url}/{key}", fn(read_bytes(f"{url}/{key}")))


def edit_manifest(url: str, fn: Callable[[dict], Any]) -> None:
    """Rewrite ``url``'s manifest as ``fn(parsed manifest)`` (a dict, or raw str/bytes)."""
    new = fn(json.loads(read_bytes(f"{url}/manifest.json")))
    if isinstance(new, str):
        new = new.encode()
    write_bytes(f"{url}/manifest.json", new if isinstance(new, bytes) else json.dumps(new).encode())


def listing(url: str) -> list[str]:
    """Every file under ``url``, relative to it, sorted (empty if nothing is there)."""
    fs, path = fs_path(url)
    if not fs.exists(path):
        return []
    return sorted(p[len(path.rstrip("/")) + 1:] for p in fs.find(path))
