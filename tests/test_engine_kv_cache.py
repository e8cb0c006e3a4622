"""Paged KV bookkeeping: reference counts, fork (page-table row copy), copy-on-write, page gathers."""

import numpy as np
import pytest
import torch

from smcdecode.backends.engine import KVPool, PagedBatch, PageTable, reference_paged_attention


def _check_counts(t: PageTable) -> None:
    expect = np.zeros_like(t.ref)
    for r in range(t.table.shape[0]):
        np.add.at(expect, t.table[r, : t.n_pages[r]], 1)
    assert (expect[1:] == t.ref[1:]).all()
    assert set(t.free) == {p for p in range(1, len(t.ref)) if t.ref[p] == 0}


def test_prompt_pages_shared_then_copy_on_write():
    t = PageTable(rows=4, max_pages=8, num_pages=32, page_size=4)
    t.reserve(np.array([0]), np.array([10]))  # prompt of 10 tokens: 3 pages, the last partial
    t.advance(np.array([0]), np.array([10]))
    t.share_prefix([0, 1, 2, 3], 0)
    assert t.used == 3 and (t.table[:, :3] == t.table[0, :3]).all()
    _check_counts(t)
    src, dst = t.reserve(np.arange(4), np.full(4, 13))
    # the partial page (tokens 8..9) is copied for 3 of the 4 rows; the full pages stay shared
    assert len(src) == 3 and len(set(dst)) == 3
    assert (t.table[:, :2] == t.table[0, :2]).all() and len(set(t.table[:, 2])) == 4
    assert t.used == 2 + 4 + 4  # 2 shared, 4 private partial pages, 4 fresh pages (12..12)
    _check_counts(t)


def test_fork_is_row_copy_with_counts_and_frees_orphans():
    t = PageTable(rows=3, max_pages=6, num_pages=32, page_size=2)
    t.reserve(np.arange(3), np.full(3, 5))
    t.advance(np.arange(3), np.full(3, 5))
    before = t.table.copy()
    t.fork(np.array([2, 2, 0]))
    assert (t.table[0] == before[2]).all() and (t.table[2] == before[0]).all()
    assert t.used == 6  # row 1's three pages were freed
    _check_counts(t)
    src, dst = t.reserve(np.arange(3), np.full(3, 6))  # page 2 of rows 0 and 1 is shared and partial
    assert len(src) == 1
    _check_counts(t)
    t.crop(np.array([0]), np.array([2]))
    t.free_rows(np.arange(3))
    assert t.used == 0 and len(t.free) == 31


def test_write_from_copies_a_shared_full_page():
    t = PageTable(rows=2, max_pages=4, num_pages=16, page_size=4)
    t.reserve(np.array([0]), np.array([8]))
    t.advance(np.array([0]), np.array([8]))
    t.share_prefix([0, 1], 0)
    src, dst = t.reserve(np.arange(2), np.full(2, 10), write_from=np.full(2, 7))
    assert len(src) == 1  # position 7 lies in a full, shared page: one row copies it
    _check_counts(t)


def test_pool_write_copy_and_paged_gather_match_dense_attention():
    torch.manual_seed(0)
    Hkv, H, D, PS = 2, 4, 8, 4
    pool = KVPool(1, Hkv, D, num_pages=16, page_size=PS, dtype=torch.float32, device="cpu")
    t = PageTable(rows=2, max_pages=4, num_pages=16, page_size=PS)
    t.reserve(np.arange(2), np.array([7, 5]))
    pt = torch.from_numpy(t.table)
    pos = torch.stack([torch.arange(7), torch.cat([torch.arange(5), torch.tensor([5, 6])])])
    k, v = torch.randn(2, 7, Hkv, D), torch.randn(2, 7, Hkv, D)
    # row 1 writes only 5 tokens; the other two entries go to the null page 0 (never read)
    batch = PagedBatch.build(pos[:, :5], pt, PS)
    pool.write(0, k[:, :5], v[:, :5], batch.slot_pages, batch.slot_offsets)
    batch = PagedBatch.build(pos[:1, 5:], pt[:1], PS)
    pool.write(0, k[:1, 5:], v[:1, 5:], batch.slot_pages, batch.slot_offsets)
    q = torch.randn(1, 2, H, D)
    batch = PagedBatch.build(torch.tensor([[5, 6]]), pt[:1], PS)
    out = reference_paged_attention(q, pool.k(0), pool.v(0), batch)
    kk = k[0].repeat_interleave(H // Hkv, 1).transpose(0, 1)  # [H, 7, D]
    vv = v[0].repeat_interleave(H // Hkv, 1).transpose(0, 1)
    mask = torch.tensor([[True] * 6 + [False], [True] * 7])
    dense = torch.nn.functional.scaled_dot_product_attention(q[0].transpose(0, 1), kk, vv, attn_mask=mask)
    torch.testing.assert_close(out[0], dense.transpose(0, 1), rtol=1e-5, atol=1e-5)
    # copy-on-write copies every layer's keys and values of a page
    pool.copy_pages(torch.tensor([int(pt[0, 1])]), torch.tensor([15]))
    assert torch.equal(pool.kv[:, :, 15], pool.kv[:, :, int(pt[0, 1])])


def _reserve_loop(t: PageTable, rows, new_lengths, write_from):
    """The row-by-row reservation (the first slice's implementation): the reference of the vectorised one."""
    PS = t.page_size
    src, dst = [], []
    for r, new_len, start in zip(rows.tolist(), new_lengths.tolist(), write_from.tolist()):
        n = int(t.n_pages[r])
        for j in range(start // PS, min(n, -(-new_len // PS))):
            page = int(t.table[r, j])
            if t.ref[page] > 1:
                (fresh,) = t._alloc(1)
                t.ref[page] -= 1
                t.table[r, j] = fresh
                src.append(page)
                dst.append(int(fresh))
        need = -(-new_len // PS) - n
        if need > 0:
            t.table[r, n : n + need] = t._alloc(need)
            t.n_pages[r] = n + need
    return src, dst


def _canonical(t: PageTable, copies):
    names: dict[int, int] = {}
    for r in range(t.table.shape[0]):
        for p in t.table[r, : t.n_pages[r]].tolist():
            names.setdefault(p, len(names))
    live = [[names[p] for p in t.table[r, : t.n_pages[r]].tolist()] for r in range(t.table.shape[0])]
    src, dst = copies
    return live, sorted(names[d] for d in dst), len(src), t.used, t.n_pages.tolist()


def test_vectorised_reserve_matches_row_loop_under_random_forks():
    import copy

    rng = np.random.default_rng(0)
    for _trial in range(30):
        R, PS = int(rng.integers(1, 9)), int(rng.integers(1, 5))
        a = PageTable(rows=R, max_pages=40, num_pages=400, page_size=PS)
        prompt = int(rng.integers(1, 12))
        a.reserve(np.array([0]), np.array([prompt]))
        a.advance(np.array([0]), np.array([prompt]))
        a.share_prefix(list(range(R)), 0)
        lens = np.full(R, prompt)
        for _ in range(6):
            rows = np.arange(R)
            grow = lens + int(rng.integers(1, 6))
            start = np.maximum(lens - int(rng.integers(0, 2)), 0)
            b = copy.deepcopy(a)
            got = a.reserve(rows, grow, write_from=start)
            want = _reserve_loop(b, rows, grow, start)
            # same structure up to page ids (the loop interleaves copy and fresh allocations)
            assert _canonical(a, got) == _canonical(b, want)
            _check_counts(a)
            lens = grow
            a.advance(rows, lens)
            a.fork(rng.integers(0, R, size=R))
            lens = a.lengths.copy()


def test_reserve_on_held_pages_books_the_pages_it_is_given():
    """``hold`` takes pages off the free list unreferenced; ``reserve(held=...)`` books row i's copy on
    held[i, 0] and its new columns on held[i, 1:], shares like ``reserve`` (same copies from the same
    pages), and returns what it did not use; too few held pages, or unholding a page in use, is an
    error."""
    def setup():
        t = PageTable(rows=4, max_pages=6, num_pages=40, page_size=4)
        t.reserve(np.array([0]), np.array([6]))  # a 6-token prompt: pages for columns 0, 1
        t.advance(np.array([0]), np.array([6]))
        t.share_prefix([0, 1, 2, 3], 0)
        t.fork(np.array([0, 0, 2, 2]))
        return t

    plain, t = setup(), setup()
    src, dst = plain.reserve(np.arange(4), np.full(4, 11), write_from=np.full(4, 5))
    held = t.hold(4 * 3).reshape(4, 3)
    assert t.used == plain.used - len(dst) - 4  # held pages are not in use (plain also opened 1 column a row)
    src2, dst2 = t.reserve(np.arange(4), np.full(4, 11), write_from=np.full(4, 5), held=held)
    assert src2 == src and len(dst2) == len(dst) == 3  # rows 0-2 copy the shared page, row 3 keeps it
    assert dst2 == held[:3, 0].tolist()
    assert (t.table[:, 2] == held[:, 1]).all()  # column 2 (positions 8-11) on each row's second held page
    assert t.used == plain.used and t.peak_used == plain.peak_used
    for c in range(3):  # the same sharing as the plain bookkeeping
        assert ((t.table[:, c][:, None] == t.table[:, c][None]) == (plain.table[:, c][:, None] == plain.table[:, c][None])).all()
    assert set(held[3, :1].tolist() + held[:, 2].tolist()) <= set(t.free)  # unused held pages are free again
    assert len(t.free) + t.used + 1 == 40

    t = setup()
    held = t.hold(4 * 2).reshape(4, 2)
    held[1, 1] = 0  # row 1 is given no page for its new column
    with pytest.raises(ValueError, match="needs more new pages than it was given"):
        t.reserve(np.arange(4), np.full(4, 11), write_from=np.full(4, 5), held=held)
    with pytest.raises(ValueError, match=r"unhold: pages \[\d+\] are in use"):
        t.unhold(t.table[0, :1])
