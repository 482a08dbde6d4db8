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
