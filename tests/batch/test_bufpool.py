"""BufferPool: batch buffers are reused once nothing refers to them, never while in use."""

from __future__ import annotations

import numpy as np
import torch

from shardkit.batch.buffers import BufferPool


def test_a_buffer_comes_back_only_when_every_view_is_gone() -> None:
    pool = BufferPool(keep=2)
    a = pool.take(1000)
    first = id(a.base)
    tensor = torch.from_numpy(a[10:20])  # a view of a view: still holds the buffer
    del a
    b = pool.take(1000)
    assert id(b.base) != first, "a buffer was handed out while a tensor still viewed it"
    del tensor
    c = pool.take(900)
    assert id(c.base) == first and c.nbytes == 900


def test_when_every_kept_buffer_is_in_use_a_one_off_buffer_is_given() -> None:
    pool = BufferPool(keep=1)
    held = [pool.take(100), pool.take(100), pool.take(100)]
    assert len({id(h.base) for h in held}) == 3
    assert pool.held_bytes() == held[0].base.nbytes  # only the first is kept
    held[0][:] = 1
    held[1][:] = 2
    assert np.all(held[0] == 1), "two live arrays share memory"
