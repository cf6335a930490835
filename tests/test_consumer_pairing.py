"""benchmarks/consumer_pairing.py counts what it says on hand-made rows."""

import numpy as np

from benchmarks.consumer_pairing import measure, pairing_stats, table


def test_pairing_stats_on_known_rows():
    # head 0: rows {1,2} and {2,3} share one tile; head 1: rows {1,2} and {5}
    sets = [[{1, 2}, {2, 3}], [{1, 2}, {5}]]
    blocks = pairing_stats(sets, "blocks")
    assert np.isclose(blocks["stream_per_work"], (3 + 3) / 7) and np.isclose(blocks["paired_work"], 2 / 7)
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
