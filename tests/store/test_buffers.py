"""The reshard's buffer pool hands a buffer out again only when nothing refers to it."""

import numpy as np
import torch

from tenplex.store.buffers import POOLED_MIN, BufferPool


def test_a_referenced_buffer_is_never_handed_out_and_a_released_one_is():
    pool = BufferPool()
    a = pool.take(POOLED_MIN * 3)
    address = a.ctypes.data
    tensor = torch.from_numpy(a[10:20]).view(torch.int16)  # a view: a keeps being used
    del a
    b = pool.take(POOLED_MIN * 3)
    assert b.ctypes.data != address
    view = memoryview(b)
    del b
    c = pool.take(POOLED_MIN * 4)  # same size class (4 x POOLED_MIN)
    assert c.ctypes.data not in (address, np.frombuffer(view, np.uint8).ctypes.data)
    del tensor, c
    d = pool.take(POOLED_MIN * 3 + 1)
    assert d.ctypes.data == address and len(d) == POOLED_MIN * 3 + 1
    assert pool.reused == POOLED_MIN * 3 + 1


def test_small_requests_and_the_limit_are_not_pooled():
    pool = BufferPool(limit=POOLED_MIN * 4)
    assert len(pool.take(100)) == 100 and pool.kept == 0
    keep = [pool.take(POOLED_MIN * 4) for _ in range(2)]
    assert pool.kept == POOLED_MIN * 4 and all(len(k) == POOLED_MIN * 4 for k in keep)


def test_a_small_tensor_inside_a_cached_block_is_copied_alone(tmp_path, monkeypatch):
    """Reading the tensors of a file in order, each block is fetched once; a tensor that lies
    inside a block fetched for its neighbour gets a buffer of its own size, not the block's."""
    from tenplex.ptree.config import ParallelConfig
    from tenplex.store.reader import StoreReader
    from tenplex.store.writer import save

    from .helpers import SPEC, state_of
    config = ParallelConfig(dp=1, tp=1, pp=1)
    tree, _, shards = state_of(SPEC, config, 0)
    save(str(tmp_path / "ck"), tree, config, shards, block=1 << 16)
    reader = StoreReader(str(tmp_path / "ck"))
    recs = sorted(reader.manifest.tensors.values(), key=lambda r: r.offset)
    block = reader.manifest.files[recs[0].file].block
    sizes, empty = [], np.empty
    monkeypatch.setattr(np, "empty", lambda n, *a, **k: sizes.append(n) or empty(n, *a, **k))
    inside = 0
    for prev, rec in zip(recs, recs[1:]):
        sizes.clear()
        reader.read(rec)
        first, last = rec.offset // block, (rec.offset + rec.nbytes - 1) // block
        if rec.nbytes and first == last == (prev.offset + prev.nbytes - 1) // block:
            inside += 1  # its only block was fetched for the tensor before it
            assert sizes and max(sizes) <= rec.nbytes, (rec.path, rec.nbytes, sizes)
    assert inside >= 3
    assert reader.bytes_read <= reader.manifest.files[recs[0].file].size  # no block fetched twice


def test_a_read_buffer_is_free_again_once_its_tensor_is_dropped(tmp_path):
    """The boundary cache keeps copies of the bytes outside a tensor, not views of the read buffer
    (views kept the last reads' buffers alive: the pool handed out fresh, page-faulting ones),
    and the neighbour is still served from it: no block is fetched twice."""
    from tenplex.ptree.config import ParallelConfig
    from tenplex.store.reader import StoreReader
    from tenplex.store.writer import save

    from .helpers import SPEC, state_of
    config = ParallelConfig(dp=1, tp=1, pp=1)
    tree, _, shards = state_of(SPEC, config, 0)
    save(str(tmp_path / "ck"), tree, config, shards, block=1 << 12)
    reader = StoreReader(str(tmp_path / "ck"))
    reader.buffers = pool = BufferPool()
    recs = sorted(reader.manifest.tensors.values(), key=lambda r: r.offset)
    big = [(a, b) for a, b in zip(recs, recs[1:]) if a.nbytes >= POOLED_MIN and (a.offset + a.nbytes) % (1 << 12)]
    assert big, "the test store needs a tensor of 256 KiB or more that ends inside a block"
    rec, neighbour = big[0]
    tensor = reader.read(rec)
    address = tensor.data_ptr()
    fetched = reader.bytes_read
    del tensor
    again = pool.take(rec.nbytes + (1 << 13))  # the size class of its read buffer
    assert again.ctypes.data <= address < again.ctypes.data + len(again)
    del again
    got = reader.read(neighbour)
    assert reader.bytes_read - fetched <= neighbour.nbytes + (1 << 12)  # its first block came from the cache
    expected = StoreReader(str(tmp_path / "ck")).read(neighbour)
    assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))


def _vm_flags(address: int) -> list[str] | None:
    """The VmFlags of this process's mapping that holds ``address`` (Linux), or None."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0] if line.strip() else ""
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return None


def test_pooled_buffers_ask_for_no_huge_pages():
    """numpy advises huge pages for every large array; where THP is 'madvise' with defrag
    'madvise' a fault on one may compact memory first (a fresh 1 GB reshard took 0.82-1.06 s
    with numpy's buffers, 0.63-0.83 s without). The pool's buffers are mappings of their own."""
    control = np.empty(8 << 20, np.uint8)
    control[:] = 1
    flags = _vm_flags(control.ctypes.data + (4 << 20))
    if flags is None or "hg" not in flags:
        import pytest
        pytest.skip("numpy advises no huge pages here (no THP, or not Linux): nothing to compare with")
    buffer = BufferPool().take(8 << 20)
    buffer[:] = 1
    assert buffer.ctypes.data % 4096 == 0
    assert "hg" not in _vm_flags(buffer.ctypes.data + (4 << 20))


def test_a_refused_buffer_is_a_memory_error(monkeypatch):
    """A mapping the kernel refuses (ENOMEM) is a MemoryError, as np.empty's would be, so the API
    and the command report exhausted memory, not a failing store (an OSError would pass through
    the store's error translation as one)."""
    import errno
    import mmap

    import pytest

    def refuse(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(MemoryError, match=f"buffer of {8 << 20} bytes"):
        BufferPool().take(8 << 20)
