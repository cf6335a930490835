"""The kernel benchmark's index families (pallas_kernels.testing.index_family, issue 34): each family
hits its density, respects the index contract, and has the shape its name promises."""

import numpy as np
import pytest

from benchmarks.kernel_cases import active_pairs
from pallas_kernels.index_format import check_step_index, row_block_map, step_index_to_mask
from pallas_kernels.testing import INDEX_FAMILIES, diagonal_index, index_family

BS = 64


def _density(idx, S):
    """Causal (query, key) pairs the index selects, as a fraction of the causal pairs (exact, via the mask)."""
    m = np.asarray(step_index_to_mask(idx, S, S, BS))
    causal = np.tril(np.ones((S, S), bool))
    return (m & causal).sum() / (m.shape[0] * m.shape[1] * causal.sum())


@pytest.mark.parametrize("family", INDEX_FAMILIES)
def test_each_family_respects_the_contract(family):
    S, H = 8192, 2
    idx = index_family(np.random.default_rng(3), family, 1, H, S, 0.1, block_size=BS, vert_cols=512)
    check_step_index(idx, 1, H, S, S, BS)
    bidx, bcnt = np.asarray(idx.block_idx), np.asarray(idx.block_count)
    for h in range(H):
        for i in range(S // BS):
            row = bidx[0, h, i, :bcnt[0, h, i]]
            assert np.all(np.diff(row) > 0) and np.all(row <= i), (family, h, i, row)  # sorted, distinct, causal
    assert np.all(np.diff(np.asarray(idx.col_idx)[0], axis=-1) > 0)  # ascending: each row uses a prefix
    assert 0.04 <= _density(idx, S) <= 0.2  # the mask (diagonal blocks half causal) near the budget


@pytest.mark.parametrize("family", INDEX_FAMILIES)
def test_each_family_hits_its_density_at_128k(family):
    """The benchmark's own count of the pairs the kernels compute (whole blocks + columns outside
    them) at 128K, the issue's 2 / 5 / 10 %."""
    S, H = 131072, 2
    for density in (0.02, 0.05, 0.1):
        idx = index_family(np.random.default_rng(3), family, 1, H, S, density, block_size=BS)
        got = sum(active_pairs(idx, S)) / (H * S * (S + 1) / 2)
        assert density * 0.85 <= got <= density * 1.1, (family, density, got)


def test_spread_diagonals_are_spread_and_the_band_is_contiguous():
    S, H, n = 32768, 4, 32768 // BS
    band = index_family(np.random.default_rng(0), "band", 1, H, S, 0.05, block_size=BS)
    spread = index_family(np.random.default_rng(0), "spread", 1, H, S, 0.05, block_size=BS)
    i = n - 1  # the last query block sees every diagonal
    b = np.asarray(band.block_idx)[0, :, i, :int(band.block_count[0, 0, i])]
    assert np.all(np.diff(b, axis=-1) == 1)  # one contiguous window below the diagonal
    offs = i - np.asarray(spread.block_idx)[0, 0, i, :int(spread.block_count[0, 0, i])]
    assert offs.max() > n // 4 and np.median(offs) > 10  # distances across the sequence, not a band
    # adjacent query blocks share few tiles under spread diagonals, nearly all under a band
    maps = {k: np.asarray(row_block_map(x, S, BS))[0, 0] for k, x in (("band", band), ("spread", spread))}
    share = {k: (m[1:] & m[:-1]).sum() / m[1:].sum() for k, m in maps.items()}
    assert share["band"] > 0.9 and share["spread"] < 0.3, share


def test_diagonal_index_is_the_diagonals_and_columns_given():
    S, n = 1024, 16
    idx = diagonal_index(1, 1, S, np.array([[0, 3, n]]), np.array([[0, 5, 700]]), block_size=BS)
    m = np.asarray(step_index_to_mask(idx, S, S, BS))[0, 0]
    q, k = np.meshgrid(np.arange(S), np.arange(S), indexing="ij")
    want = ((q // BS - k // BS == 0) | (q // BS - k // BS == 3) | np.isin(k, [0, 5, 700])) & (k <= q)
    np.testing.assert_array_equal(m & (k <= q), want)


def test_bad_family_and_density():
    with pytest.raises(ValueError, match="family must be one of .* got 'dense'"):
        index_family(np.random.default_rng(0), "dense", 1, 1, 1024, 0.1)
    with pytest.raises(ValueError, match="density must be in \\(0, 1\\], got 0"):
        index_family(np.random.default_rng(0), "band", 1, 1, 1024, 0)
