"""QueryWindow: the last W queries, their slots and RoPE positions, by row and by real token."""

from __future__ import annotations

import torch

from moend_fx.eviction.query_window import QueryWindow


def _push(win, start, n, b=2):
    q = torch.arange(start, start + n).float().expand(b, 1, n)[..., None]  # [B, 1, n, 1]: value = slot
    slots = torch.arange(start, start + n)
    win.push(q, slots, slots[None].expand(b, n) - torch.tensor([[0], [3]]))


def test_push_keeps_the_last_size_queries_in_order():
    win = QueryWindow(4)
    assert win.select() == (None, None) and win.nbytes() == 0 and win.tensors() == []
    _push(win, 0, 3)
    _push(win, 3, 1)
    _push(win, 4, 2)
    assert win.slots.tolist() == [2, 3, 4, 5]
    assert win.queries[0, 0, :, 0].tolist() == [2, 3, 4, 5]
    assert win.positions.tolist() == [[2, 3, 4, 5], [-1, 0, 1, 2]]
    _push(win, 6, 9)  # a long chunk replaces the window
    assert win.slots.tolist() == [11, 12, 13, 14]
    # 16-bit queries [2, 1, 4, 1], int32 slots [4] and positions [2, 4]: each its own storage
    assert win.nbytes() == 2 * 4 * 2 + 4 * 4 + 2 * 4 * 4 and win.tensors() == [win.queries]
    assert win.nbytes() == QueryWindow.bytes_for(batch=2, num_heads=1, head_dim=1, seen=15, size=4)
    assert win.queries.dtype == torch.float16 and win.select()[0].dtype == torch.float32
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in (win.queries, win.slots, win.positions))


def test_select_and_index_batch():
    win = QueryWindow(4)
    _push(win, 0, 4)
    q, pos = win.select(1, torch.tensor([False, True, True, False]))
    assert q.shape == (1, 1, 2, 1) and pos.tolist() == [[-2, -1]]
    win.index_batch(torch.tensor([1, 1, 0]))
    assert win.positions[:, 0].tolist() == [-3, -3, 0] and win.queries.shape[0] == 3
