"""The sm90 forward's persistent schedule (cuda/sm90/schedule.h), read through the CUDA module without a GPU:
whole tiles round robin, the last tiles' K/V blocks shared out between all blocks, and the slots the pieces of a
split tile leave their partial results in."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from jaxflash import _ffi

cuda = getattr(_ffi, "_jaxflash_cuda", None)
pytestmark = pytest.mark.skipif(cuda is None or not hasattr(cuda, "fwd_split_schedule"),
                                reason="jaxflash was built without its CUDA module")

# (tiles, K/V blocks per tile, grid): the D = 128 target shapes (2048 tiles of 128 / 32 / 8 blocks), D = 64 at
# 16k (4096 x 86), D = 256 (1024 x 205), the GPU tests' split shapes, fewer tiles than blocks, and a whole
# number of rounds (no split).
CASES = [(2048, 128, 132), (2048, 32, 132), (2048, 8, 132), (4096, 86, 132), (1024, 205, 132), (144, 16, 132),
         (240, 12, 132), (136, 21, 132), (144, 25, 132), (5, 40, 132), (264, 10, 132), (131, 3, 132),
         (2048, 128, 114), (7, 2, 4)]
rng = np.random.default_rng(0)
CASES += [(int(rng.integers(1, 3000)), int(rng.integers(1, 300)), int(rng.integers(1, 200))) for _ in range(40)]


def _units(tiles, n_blocks, grid, head_dim=128):
    return cuda.fwd_split_schedule(tiles, n_blocks, grid, head_dim)


@pytest.mark.parametrize("tiles,n_blocks,grid", CASES, ids=str)
def test_every_block_of_every_tile_once(tiles, n_blocks, grid):
    seen = np.zeros((tiles, n_blocks), np.int64)
    for units in _units(tiles, n_blocks, grid):
        for tile, lo, hi, *_ in units:
            lo, hi = (0, n_blocks) if lo < 0 else (lo, hi)
            assert 0 <= lo < hi <= n_blocks
            seen[tile, lo:hi] += 1
    np.testing.assert_array_equal(seen, 1)


@pytest.mark.parametrize("tiles,n_blocks,grid", CASES, ids=str)
def test_pieces_agree_on_parts_and_slots(tiles, n_blocks, grid):
    pieces = collections.defaultdict(list)
    all_slots = []
    for b, units in enumerate(_units(tiles, n_blocks, grid)):
        assert sum(lo >= 0 for _, lo, *_ in units) <= 2  # at most two pieces per block
        for tile, lo, hi, part, parts, slot, slots in units:
            if lo < 0:
                assert parts == 1 and not slots
                continue
            assert 2 <= parts <= 9 and 0 <= part < parts and slot in (2 * b, 2 * b + 1)
            pieces[tile].append((part, parts, slot, tuple(slots), lo, hi))
            all_slots.append(slot)
    assert len(all_slots) == len(set(all_slots))
    for tile, ps in pieces.items():
        ps.sort()
        parts = ps[0][1]
        assert [p[0] for p in ps] == list(range(parts)), tile
        assert all(p[1] == parts and p[3] == ps[0][3] for p in ps), tile
        assert list(ps[0][3]) == [p[2] for p in ps], tile  # every piece finds the others' slots
        assert [p[4] for p in ps[1:]] == [p[5] for p in ps[:-1]], tile  # pieces in block order


@pytest.mark.parametrize("tiles,n_blocks,grid", CASES, ids=str)
def test_split_shortens_the_last_round(tiles, n_blocks, grid):
    loads = [sum((n_blocks if lo < 0 else hi - lo) for _, lo, hi, *_ in units)
             for units in _units(tiles, n_blocks, grid)]
    rounds = -(-tiles // grid)
    assert max(loads) <= rounds * n_blocks
    split = any(lo >= 0 for units in _units(tiles, n_blocks, grid) for _, lo, *_ in units)
    if split:  # by at least an eighth of a tile; the blocks that share the tail differ by one K/V block at most
        assert max(loads) <= rounds * n_blocks - n_blocks / 8
        whole = (tiles // grid) * n_blocks
        shares = [x - whole for x in loads if x > whole]
        assert max(shares) - min(shares) <= 1
    if tiles % grid == 0:
        assert not split


def test_the_target_shapes_split():
    """2048 tiles on 132 SMs: 16 rounds of whole tiles become 15 and about half a tile."""
    loads = [sum((128 if lo < 0 else hi - lo) for _, lo, hi, *_ in units) for units in _units(2048, 128, 132)]
    assert max(loads) == 15 * 128 + 66


# ---- the deterministic backward's launch order (cuda/common/bwd_order.h) --------------------------------------

# (batch, heads_q, heads_k, seqlen_q, seqlen_k, block_m, block_n, SMs): the #14 target shapes at D = 64 (128 query
# rows) and D = 128 (64), GQA, fewer heads than a group, one K/V block, a partial last run, small GPUs.
ORDER_CASES = [(16, 32, 32, 1024, 1024, 128, 128, 132), (16, 16, 16, 1024, 1024, 64, 128, 132),
               (4, 16, 16, 4096, 4096, 64, 128, 132), (1, 16, 16, 16384, 16384, 64, 128, 132),
               (2, 8, 2, 2048, 2048, 64, 128, 132), (1, 3, 1, 300, 300, 64, 128, 132), (3, 4, 4, 777, 100, 128, 128, 7),
               (2, 6, 3, 5000, 2600, 64, 128, 1), (5, 2, 2, 128, 1300, 128, 128, 114)]
ORDER_CASES += [(int(rng.integers(1, 9)), 4 * int(rng.integers(1, 5)), 4, int(rng.integers(1, 9000)),
                 int(rng.integers(1, 9000)), int(rng.choice([64, 128])), 128, int(rng.integers(1, 200)))
                for _ in range(20)]


@pytest.mark.skipif(cuda is None or not hasattr(cuda, "bwd_launch_order"), reason="no CUDA module")
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("case", ORDER_CASES, ids=str)
def test_bwd_launch_order(case, descending):
    batch, hq, hk, sq, sk, bm, bn, sms = case
    heads, run, descends, blocks = cuda.bwd_launch_order(batch, hq, hk, sq, sk, bm, bn, sms, descending)
    num_bh, num_n = batch * hk, -(-sk // bn)
    steps = -(-sq // bm) * (hq // hk)
    # Descending adds where asked, but not in the long order (there they launch a causal mask's shortest blocks
    # first).
    assert descends == (descending and steps < sms)
    # Every K/V block of every head once.
    assert sorted(blocks) == [(bh, n) for bh in range(num_bh) for n in range(num_n)]
    # Each block's place in the order of adds, from the first block that adds.
    where = {(bh, num_n - 1 - n if descends else n): i for i, (bh, n) in enumerate(blocks)}
    for (bh, n), i in where.items():
        if n == 0:
            continue
        gap = i - where[(bh, n - 1)]
        assert gap > 0, "a block launched before the predecessor it waits for"
        if steps >= sms:  # long: runs of 8 adjacent blocks of one head, over every head
            assert (heads, run) == (num_bh, 8)
            assert gap == 1 or n % 8 == 0
        else:  # short: each predecessor about 1.25 * SMs / steps places earlier (all heads, if fewer)
            assert run == 1 and heads == min(num_bh, -(-5 * sms // (4 * steps)))
            width = min(heads, num_bh - bh // heads * heads)  # the last group may be narrower
            assert gap == width
