"""The ring cost model (benchmarks/comm_model.py): bytes from the schedule, overlap, calibration."""

from __future__ import annotations

import dataclasses

import pytest

import numpy as np

from benchmarks.comm_model import (Kernels, Link, Workload, backward_bytes, calibrate, exchange_bytes, exchange_need,
                                   hot_blocks, simulate)
from mtraining_jax.layouts import Layout
from mtraining_jax.sparsity.index import VerticalSlashIndex
from benchmarks import ring_comm
from benchmarks.ring_comm import ring_bytes

W = Workload(S=65536, density=0.05)
K = Kernels(rate=300e12, step_overhead=0.2e-3, index_s=2e-3, index_ref_len=65536)


@pytest.mark.parametrize("side", ["kv", "query"])
@pytest.mark.parametrize("n, l, order", [(1, 2, "hierarchical"), (1, 8, "flat"), (2, 4, "hierarchical"),
                                         (2, 4, "flat"), (4, 2, "hierarchical")])
def test_bytes_equal_the_schedule_accounting(n, l, order, side):
    p = simulate(W, n, l, order, kernels=K, backward_ring=side)
    want = ring_bytes(n, l, order, side, batch=1, chunk_len=W.S // (n * l), kv_heads=2, heads=16, head_dim=128,
                      itemsize=2)
    assert (p.bytes_inner, p.bytes_outer) == (want["inner"], want["outer"]) and p.backward_ring == side


def test_auto_side_follows_the_bytes():
    """"auto" resolves as the ring does: K/V side for GQA 16/2 (fewer bytes, less exposed time on a
    slow link), query side for MHA, where it moves fewer bytes than the K/V side."""
    slow = dict(intra=Link(20e9, 10e-6), inter=Link(5e9, 20e-6))
    mha = dataclasses.replace(W, kv_heads=16)
    for w, side in ((W, "kv"), (mha, "query")):
        auto = simulate(w, 2, 4, kernels=K, backward_ring="auto", **slow)
        other = simulate(w, 2, 4, kernels=K, backward_ring="query" if side == "kv" else "kv", **slow)
        assert auto.backward_ring == side
        assert auto.bytes_inner + auto.bytes_outer < other.bytes_inner + other.bytes_outer
        assert auto.step_s <= other.step_s


def test_one_rank_has_no_communication():
    p = simulate(W, 1, 1, kernels=K)
    assert p.bytes_inner == p.bytes_outer == 0 and p.exposed_comm_s == 0
    assert p.step_s == pytest.approx(K.index_s + W.flops / K.rate + 2 * K.step_overhead)


@pytest.mark.parametrize("n, l", [(1, 4), (2, 4), (4, 8)])
def test_more_bandwidth_is_never_slower(n, l):
    times = [simulate(W, n, l, kernels=K, intra=Link(bw, 5e-6), inter=Link(bw / 8, 10e-6)).step_s
             for bw in (1e9, 1e10, 1e11, 1e12)]
    assert all(a >= b for a, b in zip(times, times[1:])) and times[0] > times[-1]


def test_two_ranks_by_hand():
    """P = 2: forward waits for the K/V hop of step 1 (posted at the start of step 0), backward
    for the float32 dK/dV hop into step 0 (posted at the start of step 1)."""
    link = Link(bandwidth=1e9, latency=0.0)
    w = Workload(S=4096, density=1.0)
    k = dataclasses.replace(K, index_s=1e-3, index_ref_len=2048)
    p = simulate(w, 1, 2, kernels=k, intra=link)
    per = w.flops / 4 / k.rate
    cf, cb = per / 3.5 + k.step_overhead, per * 2.5 / 3.5 + k.step_overhead
    kv = 2 * 2048 * 2 * 128 * 2 / 1e9  # one K/V chunk, bf16
    dkv = 2 * 2048 * 2 * 128 * 4 / 1e9  # its float32 dK/dV
    t = 1e-3 + max(cf, kv) + cf  # forward: step 1 starts when compute and the hop are done
    exposed = max(0.0, kv - cf) + max(0.0, dkv - cb)
    t = t + max(cb, dkv) + cb
    assert p.step_s == pytest.approx(t) and p.exposed_comm_s == pytest.approx(exposed)
    assert exposed > 0  # this slow link exposes both hops


def test_query_side_backward_bytes_only_win_for_mha():
    gqa, mha = Workload(S=1, density=1.0), Workload(S=1, density=1.0, heads=16, kv_heads=16)
    assert backward_bytes(gqa, "kv") < backward_bytes(gqa, "query")
    assert backward_bytes(mha, "query") < backward_bytes(mha, "kv")
    with pytest.raises(ValueError, match="side must be"):
        backward_bytes(gqa, "both")


def test_calibration_fits_one_gpu_and_predicts_two():
    recs = [dict(run="x", S=65536, gpus=1, mesh="1x1", density=0.05, sparse_fwdbwd_s=0.02, index_s=0.002),
            dict(run="x", S=65536, gpus=2, mesh="1x2", density=0.05, sparse_fwdbwd_s=0.011)]
    rows = calibrate(recs)
    one, two = sorted(rows, key=lambda r: r["mesh"])
    assert one["rel_err"] == pytest.approx(0.0, abs=1e-9) and one["fitted_on_1gpu"]
    assert not two["fitted_on_1gpu"] and 0.005 < two["predicted_s"] < 0.02


def test_exchange_need_by_hand():
    """Contiguous layout, 4 ranks x 2 blocks of 4 tokens, one head: slash d = 0 only needs the own
    chunk; a vertical at position 1 is needed (as one column) by every later rank; a slash d = 2
    reaches exactly the previous chunk's two blocks. Uniform permutes send the max over ranks."""
    pos = Layout("contiguous", 32, 4).positions
    idx = VerticalSlashIndex(np.array([[[1, 32]]]), np.array([[1]]), np.array([[[0, 2]]]), np.array([[1]]))
    need = exchange_need(idx, pos, 4, 1)
    want = np.zeros((4, 4), int)
    want[np.arange(4), np.arange(4)] = 8  # own chunk: both blocks
    want[0, 0] = 8  # the vertical lies inside rank 0's own needed block
    want[1:, 0] = 1
    np.testing.assert_array_equal(need, want)
    idx2 = idx._replace(s_count=np.array([[2]]))
    need2 = exchange_need(idx2, pos, 4, 1)
    assert [need2[r, r - 1] for r in range(1, 4)] == [8, 8, 8]  # d = 2 blocks: the whole previous chunk
    shape = dict(chunk_len=8, block_size=4, kv_heads=1, head_dim=1, itemsize=2)
    ring = (3 + 2) * 8 * 2 * 2 + 3 * 8 * 2 * 4  # K/V forward + backward (bf16), dK/dV (float32)
    r = exchange_bytes(need, 1, 4, "flat", **shape)
    # one capacity for every step: the max need of a pair (1 token) -> one block of 4, K/V once + dK/dV
    assert r["capacity"] == 4 and r["full"] == ring
    assert r["exchange"] == 3 * 4 * 2 * (2 + 4) and r["choice"] == "exchange"
    r2 = exchange_bytes(need2, 1, 4, "flat", **shape)
    assert r2["capacity"] == 8 and r2["exchange"] == 3 * 8 * 2 * (2 + 4) and r2["choice"] == "ring"  # whole chunk
    r3 = exchange_bytes(need2, 2, 2, "hierarchical", **shape)  # 2 sends of 3 cross nodes, the ring's 1 of 3
    assert r3["outer_exchange"] > r3["outer_full"] and r3["choice"] == "ring"


@pytest.mark.parametrize("n, l, side", [(1, 8, "kv"), (4, 8, "kv"), (2, 4, "query")])
def test_exchange_bytes_equal_the_schedule_accounting(n, l, side):
    """The simulated exchange sends what ``ring_comm.exchange_link_bytes`` (checked against the
    compiled HLO) says, per link; a smaller capacity is never slower."""
    w = Workload(262144, 0.03)
    P = n * l
    cap = 0.25 * (w.S // P)
    p = simulate(w, n, l, "hierarchical", backward_ring=side, kv_exchange="sparse", capacity_fraction=0.25)
    want = ring_comm.exchange_link_bytes(n, l, "hierarchical", side, capacity=int(cap), batch=1, chunk_len=w.S // P,
                                         kv_heads=2, heads=16, head_dim=128, itemsize=2)
    assert (p.bytes_inner, p.bytes_outer) == (want["inner"], want["outer"])
    full = simulate(w, n, l, "hierarchical", backward_ring=side, kv_exchange="sparse", capacity_fraction=1.0)
    assert p.step_s <= full.step_s


def test_hot_blocks_by_hand():
    """The vertical at position 1 (rank 0's block 0) is needed by every other rank: one hot block.
    Replicating it leaves the exchange's capacity at its one-block minimum and costs the all-gather:
    it does not pay. Two slashes (d = 0, 2) make each rank's previous chunk needed by one rank only:
    no hot block."""
    pos = Layout("contiguous", 32, 4).positions
    idx = VerticalSlashIndex(np.array([[[1, 32]]]), np.array([[1]]), np.array([[[0, 2]]]), np.array([[1]]))
    h = hot_blocks(idx, pos, 4, 1, 4, "flat", kv_heads=1, head_dim=1)
    assert h["hot_blocks"] == 1 and h["capacity"] == h["capacity_replicated"] == 4 and not h["pays"]
    assert h["exchange_bytes_replicated"] > h["exchange_bytes"]
    h2 = hot_blocks(idx._replace(v_count=np.array([[0]]), s_count=np.array([[2]])), pos, 4, 1, 4, "flat",
                    kv_heads=1, head_dim=1)
    assert h2["hot_blocks"] == 0 and h2["exchange_bytes_replicated"] == h2["exchange_bytes"]
