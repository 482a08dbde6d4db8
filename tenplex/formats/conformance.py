"""A conformance suite every :class:`~tenplex.formats.protocol.Format` can join with one class.

Shipped with the library, as fsspec ships its abstract filesystem tests: a
format's test module subclasses :class:`FormatConformance`, sets ``format``
(and overrides the hooks where its checkpoints need more), and pytest
collects the inherited tests. The suite needs no megatron-core: its source
is a tenplex store of random tensors, saved in memory-sized files, so it
runs in seconds. Each test:

- ``test_detects_and_describes``: ``detect`` finds what ``write`` wrote and
  ``describe`` gives back the tree and the target config;
- ``test_write_then_open_is_bit_exact``: every global tensor read back
  through ``open_source`` equals the source's (logical rows), bit for bit;
- ``test_verify_finds_a_flipped_byte``: one flipped byte in the middle of
  the largest data file makes ``verify`` raise ``CorruptShardError``. A
  format whose files carry no checksums (safetensors) says so honestly:
  ``verify_checks_data = False``; the test then shows that such a flip is
  *not* found (the declaration is true), and that a flipped byte at each of
  the format's :meth:`~FormatConformance.structure_bytes` (headers, index)
  is found (``CorruptShardError`` or ``ManifestError``);
- ``test_an_interrupted_write_leaves_nothing``: a source read that fails
  mid-write reaches the caller, and nothing is left at the target path;
- ``test_refuses_a_hostile_metadata_file``: a metadata file replaced by
  bytes that lie makes ``describe`` raise a ``TenplexError`` subclass (and
  nothing else).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tenplex.errors import CorruptShardError, ManifestError, TenplexError
from tenplex.formats.protocol import Format
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree.config import ParallelConfig
from tenplex.ptree.shards import assemble, materialize
from tenplex.ptree.tree import PTree
from tenplex.store.reader import StoreReader
from tenplex.store.writer import save

__all__ = ["FormatConformance", "count_open_store_files", "global_tensors"]


def global_tensors(source) -> dict[str, torch.Tensor]:
    """Every tensor leaf of a shard source, assembled into its global tensor (logical rows)."""
    config, out = source.config, {}
    for path, _ in source.tree.tensors():
        shards: dict[int, dict] = {r: {} for r in range(config.world_size)}
        for r in range(config.world_size):
            if source.sharding.holding(path, config.coord(r)) is not None:
                shards[r][path] = source.read(source.record(path, r))
        sub = type(source.tree)({path: source.tree[path]}, source.tree.num_layers)
        out[path] = assemble(sub, config, shards, padded=False)[path]
    return out


class _FailingSource:
    """A shard source whose ``fail_at``-th read raises, to interrupt a write."""

    def __init__(self, source, fail_at: int):
        self._source, self._left = source, fail_at

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def read(self, record, starts=None, ends=None):
        self._left -= 1
        if self._left < 0:
            raise CorruptShardError("conformance: an injected read error")
        return self._source.read(record, starts, ends)


def count_open_store_files(monkeypatch) -> list[int]:
    """Count the store shard files a writer holds open at once, for the rest of the test.

    Args:
        monkeypatch: pytest's ``monkeypatch`` fixture (the counting undoes itself after the test).

    Returns:
        A one-element list whose entry is the peak number of shard files open at the same time
        so far; it grows as the test writes.
    """
    import tenplex.store.writer as writer_module

    live, peak = set(), [0]
    opened, closed = writer_module._FileWriter.__init__, writer_module._FileWriter.close

    def counting_init(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        live.add(id(self))
        peak[0] = max(peak[0], len(live))

    def counting_close(self):
        live.discard(id(self))
        return closed(self)

    monkeypatch.setattr(writer_module._FileWriter, "__init__", counting_init)
    monkeypatch.setattr(writer_module._FileWriter, "close", counting_close)
    return peak


def _flip(file: str, offset: int) -> None:
    """Invert every bit of byte ``offset`` of ``file`` (twice restores it)."""
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


class FormatConformance:
    """The suite; subclass it in a test module and set :attr:`format`.

    Hooks (override where the format needs them):
        make_tree: the tree to write (default: a 2-layer GPT with GQA).
        make_state: the global state (default: random tensors, the tree's values).
        meta: the source's meta (e.g. a Megatron model config).
        source_config, target_config: the configs written from and to.
        metadata_file: the file ``describe`` reads first (to make hostile).
        structure_bytes: bytes ``verify`` must find flipped where it cannot check data.
    """

    format: Format
    verify_checks_data: bool = True
    """Whether ``verify`` finds any flipped data byte (the format keeps checksums). A format
    without them sets False and lists :meth:`structure_bytes`."""
    source_config = ParallelConfig(dp=1, tp=2, pp=1)
    target_config = ParallelConfig(dp=1, tp=1, pp=2)

    def make_tree(self) -> PTree:
        return gpt_tree(GPTSpec(num_layers=2, hidden=32, heads=4, query_groups=2, ffn=64, vocab=96,
                                seq_len=16, dtype="float32"))

    def make_state(self, tree: PTree, config: ParallelConfig) -> dict[str, Any]:
        return random_state(tree, config, seed=7)

    def meta(self, tree: PTree) -> dict:
        return {}

    def metadata_file(self, path: str) -> str:
        raise NotImplementedError(f"{type(self).__name__}: say which file describe() reads first")

    def structure_bytes(self, path: str) -> list[tuple[str, int]]:
        """``[(file, byte offset)]`` of ``path`` that ``verify`` finds flipped, where
        :attr:`verify_checks_data` is False (header lengths, headers, indexes)."""
        return []

    # -- fixtures --------------------------------------------------------------------------------

    @pytest.fixture
    def source(self, tmp_path):
        tree, config = self.make_tree(), self.source_config
        state = self.make_state(tree, config)
        shards = {r: materialize(tree, state, config, r) for r in range(config.world_size)}
        save(str(tmp_path / "source"), tree, config, shards, meta=self.meta(tree))
        return StoreReader(str(tmp_path / "source"))

    @pytest.fixture
    def written(self, source, tmp_path) -> str:
        path = str(tmp_path / "written")
        self.format.write(source, path, self.target_config)
        return path

    # -- the suite -------------------------------------------------------------------------------

    def test_detects_and_describes(self, source, written):
        assert self.format.detect(written)
        assert not self.format.detect(os.path.dirname(written) + "/nothing-here")
        d = self.format.describe(written)
        assert d.format == self.format.name
        assert (d.config.tp, d.config.pp) == (self.target_config.tp, self.target_config.pp)
        assert [p for p, _ in d.tree.tensors()] == [p for p, _ in source.tree.tensors()]

    def test_write_then_open_is_bit_exact(self, source, written):
        want, got = global_tensors(source), global_tensors(self.format.open_source(written))
        assert list(got) == list(want)
        for path, tensor in want.items():
            assert got[path].dtype == tensor.dtype and torch.equal(got[path], tensor), path

    def test_verify_finds_a_flipped_byte(self, written):
        self.format.verify(written)
        files = [os.path.join(d, f) for d, _, names in os.walk(written) for f in names]
        largest = max(files, key=os.path.getsize)
        _flip(largest, os.path.getsize(largest) // 2)
        if self.verify_checks_data:
            with pytest.raises(CorruptShardError):
                self.format.verify(written)
            return
        self.format.verify(written)  # declared: a flipped data byte is not found
        _flip(largest, os.path.getsize(largest) // 2)
        spots = self.structure_bytes(written)
        assert spots, f"{type(self).__name__}: verify checks no data; name the bytes it does check"
        for file, offset in spots:
            _flip(file, offset)
            with pytest.raises((CorruptShardError, ManifestError)):
                self.format.verify(written)
            _flip(file, offset)
        self.format.verify(written)

    def test_an_interrupted_write_leaves_nothing(self, source, tmp_path):
        path = str(tmp_path / "interrupted")
        with pytest.raises(CorruptShardError, match="injected"):
            self.format.write(_FailingSource(source, 3), path, self.target_config)
        assert not self.format.detect(path)
        assert not os.path.exists(path) or not os.listdir(path), os.listdir(path)

    def test_refuses_a_hostile_metadata_file(self, written):
        target = self.metadata_file(written)
        size = os.path.getsize(target)
        with open(target, "wb") as f:
            f.write((b"\x80\x05\x95" + (1 << 62).to_bytes(8, "little") + b"{" * 64)[:max(size, 16)])
        with pytest.raises(TenplexError):
            self.format.describe(written)
