"""Layout permutations (property tests): exact inverses, per-rank positions, causal work balance."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtraining_jax.layouts import LAYOUTS, Layout, causal_work_per_rank, inverse_permutation, layout_permutation


@st.composite
def layouts(draw, names=LAYOUTS):
    """A valid (name, S, P, stripe): S is a multiple of each layout's divisibility unit."""
    name = draw(st.sampled_from(names))
    P = draw(st.integers(1, 8))
    stripe = draw(st.sampled_from([1, 2, 4, 8, 16, 64]))
    unit = {"zigzag": 2 * P, "block_striped": stripe * P}.get(name, P)
    m = draw(st.integers(1, max(1, 512 // unit)))
    return Layout(name, unit * m, P, stripe)


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_perm_is_a_permutation_with_exact_inverse(lay):
    perm, inv = lay.perm, lay.inverse
    assert perm.dtype == np.int32 and inv.dtype == np.int32
    np.testing.assert_array_equal(np.sort(perm), np.arange(lay.seq_len))
    np.testing.assert_array_equal(perm[inv], np.arange(lay.seq_len))
    np.testing.assert_array_equal(inv[perm], np.arange(lay.seq_len))
    np.testing.assert_array_equal(inverse_permutation(inv), perm)


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_positions_are_contiguous_shards_of_perm(lay):
    pos = lay.positions
    assert pos.shape == (lay.num_ranks, lay.local_len)
    for r in range(lay.num_ranks):
        np.testing.assert_array_equal(lay.rank_positions(r), lay.perm[r * lay.local_len:(r + 1) * lay.local_len])


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_positions_follow_the_layout_definition(lay):
    """Each rank holds exactly the tokens the module docstring says, in increasing order."""
    S, P, w = lay.seq_len, lay.num_ranks, lay.stripe
    t = np.arange(S)
    for r, pos in enumerate(lay.positions):
        if lay.name == "contiguous":
            want = t[r * S // P:(r + 1) * S // P]
        elif lay.name == "zigzag":
            c = S // (2 * P)
            want = np.concatenate([t[r * c:(r + 1) * c], t[(2 * P - 1 - r) * c:(2 * P - r) * c]])
        elif lay.name == "token_striped":
            want = t[t % P == r]
        else:
            want = t[(t // w) % P == r]
        np.testing.assert_array_equal(pos, want)


@settings(max_examples=30, deadline=None)
@given(layouts(), st.integers(0, 2**31 - 1))
def test_permute_unpermute_round_trip_numpy_and_jax(lay, seed):
    x = np.random.default_rng(seed).standard_normal((2, lay.seq_len, 3))
    laid = lay.permute(x)
    np.testing.assert_array_equal(laid[:, 3 % lay.seq_len], x[:, lay.perm[3 % lay.seq_len]])
    np.testing.assert_array_equal(lay.unpermute(laid), x)
    xj = jnp.asarray(x)
    np.testing.assert_array_equal(np.asarray(lay.unpermute(lay.permute(xj))), x)
    np.testing.assert_array_equal(np.asarray(lay.permute(xj)), laid)


@settings(max_examples=60, deadline=None)
@given(layouts(names=("zigzag", "token_striped", "block_striped")))
def test_causal_work_balance(lay):
    """Causal (q, k) pairs per rank: zigzag is exactly balanced; the striped layouts differ between
    adjacent ranks by one stripe's offset per token (``w * S/P``); contiguous is the worst."""
    work = causal_work_per_rank(lay.name, lay.seq_len, lay.num_ranks, lay.stripe)
    S, P, sl = lay.seq_len, lay.num_ranks, lay.local_len
    assert work.sum() == S * (S + 1) // 2
    w = {"zigzag": 0, "token_striped": 1, "block_striped": lay.stripe}[lay.name]
    np.testing.assert_array_equal(np.diff(work), np.full(P - 1, w * sl))
    contiguous = causal_work_per_rank("contiguous", S, P)
    assert work.max() - work.min() <= contiguous.max() - contiguous.min()
    if P > 1 and S >= 4 * P * max(w, 1):
        assert work.max() / work.mean() < contiguous.max() / contiguous.mean()


def test_contiguous_imbalance_closed_form():
    work = causal_work_per_rank("contiguous", 64, 4)
    sl = 16
    np.testing.assert_array_equal(work, [sum(range(r * sl + 1, (r + 1) * sl + 1)) for r in range(4)])


@pytest.mark.parametrize(
    "args,match",
    [
        (("spiral", 64, 4), r"unknown layout 'spiral'"),
        (("contiguous", 63, 4), r"sequence length 63 is not divisible by the number of ranks 4"),
        (("token_striped", 10, 4), r"sequence length 10 is not divisible by the number of ranks 4"),
        (("zigzag", 36, 4), r"sequence length 36 is not divisible by 2 x ranks = 8"),
        (("block_striped", 192, 4), r"sequence length 192 is not divisible by stripe x ranks = 64 x 4 = 256"),
        (("block_striped", 64, 4, 0), r"stripe must be positive, got 0"),
        (("contiguous", 64, 0), r"num_ranks must be a positive integer, got 0"),
        (("contiguous", 0, 4), r"seq_len must be a positive integer, got 0"),
    ],
)
def test_bad_layouts_raise(args, match):
    with pytest.raises(ValueError, match=match):
        Layout(*args)
    with pytest.raises(ValueError, match=match):
        layout_permutation(*args)
