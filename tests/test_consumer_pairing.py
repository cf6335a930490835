"""benchmarks/consumer_pairing.py counts what it says on hand-made rows."""

import numpy as np

import pytest

from benchmarks.consumer_pairing import kv_pairing_stats, main, measure, measure_model, pairing_stats, row_sets, table


def test_pairing_stats_on_known_rows():
    # head 0: rows {1,2} and {2,3} share one tile; head 1: rows {1,2} and {5}
    sets = [[{1, 2}, {2, 3}], [{1, 2}, {5}]]
    blocks = pairing_stats(sets, "blocks")
    assert np.isclose(blocks["stream_per_work"], (3 + 3) / 7) and np.isclose(blocks["paired_work"], 2 / 7)
    # per CTA: head 0 carries 3 of 4 (0.75, above SPLIT_ABOVE 0.7), head 1 3 of 3 (1.0): all the work above
    assert np.isclose(blocks["cta_q10"], 0.775) and np.isclose(blocks["cta_q90"], 0.975)
    assert np.isclose(blocks["cta_q50"], 0.875) and blocks["work_above_split"] == 1.0
    mixed = pairing_stats([[{1, 2}, {1, 2}], [{1, 2}, {5}]], "blocks")  # 0.5 (4 tiles) and 1.0 (3 tiles)
    assert np.isclose(mixed["work_above_split"], 3 / 7)
    heads = pairing_stats(sets, "heads")  # (h0 row0, h1 row0) share {1,2}; (h0 row1, h1 row1) nothing
    assert np.isclose(heads["stream_per_work"], (2 + 3) / 7) and np.isclose(heads["paired_work"], 4 / 7)
    sep = pairing_stats(sets, "separate")
    assert sep["stream_per_work"] == 1.0 and np.isclose(sep["paired_work"], (4 + 2) / 7)


def test_a_band_shares_almost_everything_and_spread_diagonals_do_not():
    rows = measure(8192, [0.1], families=("band", "spread"), heads=4)
    by = {(r["family"], r["pairing"]): r for r in rows}
    assert by["band", "blocks"]["paired_work"] > 0.8
    assert by["spread", "blocks"]["paired_work"] < 0.5
    assert by["spread", "separate"]["paired_work"] > 0.9
    assert "| spread | 10% |" in table(rows)


def test_a_saved_model_index_is_measured_like_a_family(tmp_path, capsys):
    """--model-index: the pairing of a saved index (here a hand-made band: slashes 0-3 of every head, no
    verticals) equals the synthetic analysis of the same StepIndex; a file that is not one is refused."""
    import jax.numpy as jnp

    from benchmarks.model_index import save_indices
    from mtraining_jax.sparsity.index import VerticalSlashIndex

    S, H = 2048, 2
    vs = VerticalSlashIndex(v_idx=jnp.full((1, H, 4), S, jnp.int32), v_count=jnp.zeros((1, H), jnp.int32),
                            s_idx=jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (1, H, 4)),
                            s_count=jnp.full((1, H), 4, jnp.int32))
    path = str(tmp_path / "band.npz")
    save_indices(path, [(3, {}, vs), (3, {"slash_max": 4}, vs)], dict(seq_len=S, block_size=64))
    rows = measure_model(path, heads=4)
    assert [(r["family"], r["pairing"]) for r in rows[:4]] == [("model_L3", p)
                                                               for p in ("blocks", "heads", "separate", "kv_blocks")]
    assert rows[4]["family"] == "model_L3_slash_max4"
    by = {r["pairing"]: r for r in rows[:4]}
    # a band of 4 diagonals: query block i lists blocks i-3..i; rows 2p, 2p+1 share 3 of their tiles
    nqb = S // 64
    work = sum(min(i + 1, 4) for i in range(nqb))
    union = sum(len(set(range(max(0, 2 * p - 3), 2 * p + 1)) | set(range(max(0, 2 * p - 2), 2 * p + 2)))
                for p in range(nqb // 2))
    assert np.isclose(by["blocks"]["stream_per_work"], union / work)
    assert np.isclose(by["heads"]["stream_per_work"], 0.5)  # repeated heads list the same tiles
    # dK/dV: KV block j is listed by query blocks j..j+3; KV blocks 2p, 2p+1 by 2p..2p+4 (5 of 8 tiles)
    kv_work = sum(len(range(j, min(j + 4, nqb))) for j in range(nqb))
    kv_union = sum(len(range(2 * p, min(2 * p + 5, nqb))) for p in range(nqb // 2))
    assert np.isclose(by["kv_blocks"]["stream_per_work"], kv_union / kv_work) and by["kv_blocks"]["kv_heads"] == 2
    pairs = nqb * 64 * 65 // 2 + sum((nqb - d) * 64 * 64 for d in (1, 2, 3))  # diagonal 0 is causal inside
    assert np.isclose(rows[0]["density"], pairs / (S * (S + 1) / 2))
    assert main(["--model-index", path, "--heads", "4"]) == 0 and "| model_L3 |" in capsys.readouterr().out
    np.save(tmp_path / "x.npy", np.zeros(2))
    assert main(["--model-index", str(tmp_path / "x.npy")]) == 1
    assert "is not a model index file" in capsys.readouterr().err


def test_kv_pairing_on_known_rows():
    """The dK/dV block pass's pairing: KV blocks 2p, 2p+1 of one KV head over its group's query heads."""
    # 2 query heads, 1 KV head: head 0 row 0 lists KV {0, 1}, row 1 lists {1}; head 1 row 1 lists {0}
    sets = [[{0, 1}, {1}], [set(), {0}]]
    # KV 0 <- {(0, 0), (1, 1)}, KV 1 <- {(0, 0), (0, 1)}: union 3 of 4 tiles, (0, 0) paired
    got = kv_pairing_stats(sets, kv_heads=1)
    assert np.isclose(got["stream_per_work"], 3 / 4) and np.isclose(got["paired_work"], 2 / 4)
    # 2 KV heads: head 0 alone (KV 0 <- (0,0); KV 1 <- (0,0), (0,1)); head 1 alone (KV 0 <- (1,1))
    got = kv_pairing_stats(sets, kv_heads=2)
    assert np.isclose(got["stream_per_work"], (2 + 1) / 4) and np.isclose(got["paired_work"], 2 / 4)
    with pytest.raises(ValueError, match="kv_heads=3 must divide the 2 query heads"):
        kv_pairing_stats(sets, kv_heads=3)


def test_a_band_pairs_its_dkv_tiles_and_spread_diagonals_do_not():
    rows = measure(8192, [0.1], families=("band", "spread"), heads=4, kv_heads=2)
    by = {(r["family"], r["pairing"]): r for r in rows}
    assert by["band", "kv_blocks"]["stream_per_work"] < 0.6  # a band: KV blocks j, j+1 share nearly every row
    assert by["spread", "kv_blocks"]["stream_per_work"] > by["band", "kv_blocks"]["stream_per_work"] + 0.2
    lines = table(rows).splitlines()
    assert lines[3].startswith("| spread | 10% |") and f"| {by['spread', 'kv_blocks']['stream_per_work']:.2f} |" in lines[3]


def test_the_column_pairing_is_the_shared_column_walk():
    """``col_chunks``: what the column dK/dV pass's shared walk (``col_walk="shared"``) carries per tile
    of work is the kernels' own walk (``column_pair_walk`` over ``column_ranges``) summed over its CTAs;
    on the vertical-heavy family adjacent chunks' walks overlap almost wholly (about half the loads)."""
    from benchmarks.consumer_pairing import col_pairing_stats
    from pallas_kernels.mosaic_index import column_ranges
    from pallas_kernels.mosaic_stream import column_pair_walk
    from pallas_kernels.testing import index_family

    idx = index_family(np.random.default_rng(5), "vert", 1, 2, 8192, 0.1)
    R = 32
    got = col_pairing_stats(idx, range_blocks=R)
    mcp = -(-idx.max_cols // 128) * 128
    first, end, nr = column_ranges(idx.col_count, mcp // 64, 64, R)
    first, end = np.asarray(first), np.asarray(end)
    carried = work = 0
    for h, p, r in np.ndindex(2, mcp // 128, nr):
        w = []
        for c in (2 * p, 2 * p + 1):
            lo = max(first[0, h, c], r * R)
            w += [lo, max(min(end[0, h, c], (r + 1) * R), lo)]
        carried += int(column_pair_walk(*(np.int32(x) for x in w))[0])
        work += w[1] - w[0] + w[3] - w[2]
    assert work > 0 and got["stream_per_work"] == pytest.approx(carried / work) and got["stream_per_work"] < 0.6
    assert got["paired_work"] == pytest.approx(2 * (work - carried) / work)
    by = {(r["family"], r["pairing"]): r for r in measure(8192, [0.1], families=("vert", "band"), heads=2)}
    assert by["vert", "col_chunks"]["stream_per_work"] < 0.6 and "| vert | 10% |" in table(list(by.values()))


@pytest.mark.parametrize("family", ["band", "spread", "vert"])
def test_the_dkv_kernels_share_is_the_pairing_count(family):
    """The tiles the dK/dV block pass's shared stream carries per tile of work, from the kernels' own
    schedules (``kv_pair_schedule``'s segment bounds over ``kv_schedule``'s counts), is ``kv_blocks``'
    count here, on the same index."""
    import jax.numpy as jnp

    from pallas_kernels.mosaic_index import kv_pair_schedule, kv_schedule

    def kv_stream_per_work(counts, bounds):  # 0.5: both KV blocks listed by the same tiles; 1.0: none shared
        carried = (bounds[..., -1] - bounds[..., 0]).astype(jnp.float32).sum()
        return carried / jnp.maximum(counts[..., 1].astype(jnp.float32).sum(), 1.0)
    from pallas_kernels.testing import index_family

    S, H, hkv = 8192, 4, 2
    idx = index_family(np.random.default_rng(5), family, 1, H, S, 0.1)
    want = kv_pairing_stats(row_sets(idx), kv_heads=hkv)["stream_per_work"]
    idx = type(idx)(*map(jnp.asarray, idx))
    got = float(kv_stream_per_work(kv_schedule(idx, S, hkv, 64)[1], kv_pair_schedule(idx, S, hkv, 64)[1]))
    assert 0.5 <= want <= 1.0 and got == pytest.approx(want, rel=1e-6), (family, got, want)
