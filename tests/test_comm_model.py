"""The ring cost model (benchmarks/comm_model*.py): bytes from the schedule, overlap, calibration (the earlier
rate-only rule and the traced per-step model of issue 33)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

import numpy as np

from benchmarks.comm_model import main
from benchmarks.comm_model_exchange import exchange_bytes, exchange_need, hot_blocks
from benchmarks.comm_model_fit import read_records, calibrate, calibrate_traced, fit_step_terms, held_out_error
from benchmarks.comm_model_sim import (BWD_SHARE, DQ_SHARE, NVLINK_H200, Kernels, Link, RingCosts, Workload,
                                       backward_bytes, simulate, simulate_fused)
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


# ------------------------------------------------------------------ the fused ring with per-step costs (issue 33)

FAST = Link(bandwidth=1e18, latency=0.0)
TRUE = RingCosts(rate=300e12, call_row_s=2e-8, index_token_s=1e-8, xla_token_s=3e-8, step_fixed_s=0.5e-3,
                 step_row_s=1e-8, host_s=2e-3)
SYN_S, SYN_DENSITY = 65536, 0.05
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RING = os.path.join(HERE, "results", "ring", "ring.jsonl")  # every ring measurement, ``run`` = the campaign


def _trace(kernels_ms, index_ms, rest_ms, step_ops=()):
    """A ``sparse_trace`` of one traced device as ``benchmarks/trace_summary.py`` writes it."""
    top = [dict(name="anonymous_mosaic_gpu_kernel", ms=kernels_ms, count=4),
           dict(name="input_reduce_fusion", ms=index_ms, count=1, op="jit(f)/jvp()/reduce_sum",
                src="estimate.py:179 < mtraining.py:202"),
           dict(name="wrapped_convert", ms=rest_ms, count=1, op="jit(f)/transpose(jvp())/convert_element_type",
                src="attention.py:306 < mtraining.py:206"),
           dict(name="ncclDevKernel_SendRecv", ms=1.0, count=2)]
    top += [dict(name=f"fusion_{op}", ms=ms, count=n, op=f"jit(f)/jvp()/{op}", src="steps.py:85")
            for op, ms, n in step_ops]
    compute = kernels_ms + index_ms + rest_ms + sum(ms for _, ms, _ in step_ops)
    return {"/device:GPU:0": dict(kernels=100, span_ms=compute, compute_ms=compute, comm_ms=1.0, exposed_comm_ms=0.0,
                                  idle_ms=0.0, top=top),
            "/device:GPU:1": dict(kernels=0)}


def _synthetic(n, l, order="hierarchical", run="syn", S=SYN_S, true=TRUE):
    """A traced record generated from ``true`` costs (no exposed communication: a fast link): its
    measured time is the model's own prediction, its trace the model's parts."""
    P, w = n * l, Workload(S, SYN_DENSITY)
    rows = S // P
    calls = 1 if P == 1 else P - 1  # per pass, both passes fused
    kernels = (w.flops / P / true.rate + true.call(rows) * calls) * 1e3
    steps = [] if P == 1 else [("stack", (P - 1) * true.step_row_s * rows * 1e3, P - 1),  # >= 0.1 ms a launch
                               ("sort", (P - 1) * true.step_fixed_s * 1e3, 100 * (P - 1))]  # 5 us a launch
    t = simulate_fused(w, n, l, order, costs=true, intra=FAST, inter=FAST).step_s
    return dict(run=run, S=S, mesh=f"{n}x{l}", nodes=n, local=l, gpus=P, ring_order=order, fuse="both",
                density=SYN_DENSITY, sparse_fwdbwd_s=t, hlo_collective_permute_sync=0,
                sparse_trace=_trace(kernels, true.index_token_s * rows * 1e3, true.xla_token_s * rows * 1e3, steps))


def test_fused_one_rank_is_the_sum_of_its_costs():
    w = Workload(SYN_S, SYN_DENSITY)
    p = simulate_fused(w, 1, 1, costs=TRUE)
    want = (w.flops / TRUE.rate + TRUE.call_row_s * SYN_S + (TRUE.index_token_s + TRUE.xla_token_s) * SYN_S
            + TRUE.host_s)
    assert p.step_s == pytest.approx(want, rel=1e-12) and p.exposed_comm_s == 0 and p.xla_step_s == 0
    assert p.calls == 1 and p.bytes_inner == p.bytes_outer == 0


def test_fused_two_ranks_by_hand():
    """P = 2, fused: ONE forward call waits for the K/V hop (posted at time 0, overlapping the index
    estimate); ONE backward call (steps 1 and 0), after which the float32 dK/dV of the own chunk comes
    home while the remaining XLA work runs. A slow link exposes both hops."""
    link = Link(bandwidth=1e9, latency=0.0)
    w = Workload(S=8192, density=1.0)
    c = RingCosts(rate=300e12, call_row_s=1e-8, index_token_s=1e-8, xla_token_s=2e-8, step_fixed_s=0.2e-3, host_s=1e-3)
    p = simulate_fused(w, 1, 2, costs=c, intra=link)
    rows = 4096
    work, call, prep = w.flops / 4 / c.rate, c.call_row_s * rows, c.step_fixed_s / 2
    index, post = c.index_token_s * rows, c.xla_token_s * rows
    kv = 2 * rows * 2 * 128 * 2 / 1e9  # one bf16 K/V chunk
    dkv = 2 * rows * 2 * 128 * 4 / 1e9  # its float32 dK/dV
    assert kv > index + prep and dkv > post
    t = kv + (2 * work + call) * (1 - BWD_SHARE)  # the forward call starts when the hop has arrived
    t += prep + (2 * work + call) * BWD_SHARE  # one backward call, no K/V hop (it holds both chunks)
    exposed = (kv - index - prep) + (dkv - post)
    assert p.step_s == pytest.approx(t + dkv + c.host_s, rel=1e-12)
    assert p.exposed_comm_s == pytest.approx(exposed, rel=1e-12) and p.calls == 1
    assert p.xla_step_s == pytest.approx(2 * prep)  # one step beyond the first, half per pass


def test_fused_dkv_hop_waits_only_for_the_dkv_kernels():
    """The dK/dV hop into a backward call is waited for after the call's dQ kernel: a hop shorter than
    the step's XLA work + dQ kernel is hidden; a longer one shows exactly the difference."""
    w = Workload(S=65536, density=0.05)
    c = dataclasses.replace(TRUE, host_s=0.0, index_token_s=1e-6)  # a long index estimate hides the first hop
    rows = w.S // 4
    work, call, prep = w.flops / 16 / c.rate, c.call_row_s * rows, c.step_xla(rows) / 2
    before_dkv = prep + (work + call) * BWD_SHARE * DQ_SHARE
    dkv_bytes = 2 * rows * 2 * 128 * 4
    hidden = simulate_fused(w, 1, 4, costs=c, intra=Link(dkv_bytes / (0.5 * before_dkv), 0.0))
    assert hidden.exposed_comm_s == pytest.approx(0.0, abs=1e-12)
    slow = Link(dkv_bytes / (before_dkv + 1e-3), 0.0)  # every dK/dV hop 1 ms longer than what hides it
    p = simulate_fused(w, 1, 4, costs=dataclasses.replace(c, index_token_s=1e-3), intra=slow)
    assert p.exposed_comm_s >= 2 * 1e-3 - 1e-9  # the two dK/dV hops into backward calls at least


@pytest.mark.parametrize("n, l, order", [(1, 2, "hierarchical"), (1, 8, "flat"), (2, 4, "hierarchical"),
                                         (2, 4, "flat"), (4, 8, "hierarchical")])
def test_fused_bytes_equal_the_schedule_accounting(n, l, order):
    p = simulate_fused(W, n, l, order, costs=TRUE)
    want = ring_bytes(n, l, order, "kv", batch=1, chunk_len=W.S // (n * l), kv_heads=2, heads=16, head_dim=128,
                      itemsize=2)
    assert (p.bytes_inner, p.bytes_outer) == (want["inner"], want["outer"])
    assert p.calls == n * l - 1 and p.steps == n * l


@pytest.mark.parametrize("n, l, order", [(1, 4, "hierarchical"), (2, 4, "hierarchical"), (4, 8, "hierarchical"),
                                         (4, 8, "flat")])
def test_fused_more_bandwidth_is_never_slower(n, l, order):
    times = [simulate_fused(W, n, l, order, costs=TRUE, intra=Link(bw, 5e-6), inter=Link(bw / 8, 10e-6)).step_s
             for bw in (1e9, 1e10, 1e11, 1e12)]
    assert all(a >= b for a, b in zip(times, times[1:])) and times[0] > times[-1]


def test_step_forms_agree_at_the_fitted_chunk():
    rows = 16384
    forms = {f: TRUE.with_form(f, rows) for f in ("split", "fixed", "chunk")}
    assert all(c.step_xla(rows) == pytest.approx(TRUE.step_xla(rows)) for c in forms.values())
    assert forms["fixed"].step_xla(rows / 4) == pytest.approx(TRUE.step_xla(rows))
    assert forms["chunk"].step_xla(rows / 4) == pytest.approx(TRUE.step_xla(rows) / 4)
    assert forms["chunk"].step_xla(rows / 4) < TRUE.step_xla(rows / 4) < forms["fixed"].step_xla(rows / 4)
    with pytest.raises(ValueError, match="form must be"):
        TRUE.with_form("length", rows)


def test_traced_fit_recovers_the_costs_it_was_generated_from():
    """Synthetic traced records generated from known costs: the per-call and per-step terms fitted on
    the 1x4 trace and the one-GPU record give back every cost, and the model then reproduces the
    held-out records (1x2, 1x8, 2x4 flat) it never saw."""
    recs = [_synthetic(1, 1), _synthetic(1, 4), _synthetic(1, 2), _synthetic(1, 8), _synthetic(2, 4, "flat")]
    rows, terms, costs = calibrate_traced(recs, fit=("syn", "1x4", "hierarchical"), intra=FAST)
    got = costs["syn"]
    for f in ("rate", "call_row_s", "index_token_s", "xla_token_s", "step_fixed_s", "step_row_s", "host_s"):
        assert getattr(got, f) == pytest.approx(getattr(TRUE, f), rel=1e-9), f
    assert terms["row_fraction"] == pytest.approx(TRUE.step_row_s * 16384 / TRUE.step_xla(16384), rel=1e-9)
    roles = {r["mesh"] + " " + r["ring_order"]: r["role"] for r in rows}
    assert roles == {"1x1 hierarchical": "fit: 1 GPU", "1x4 hierarchical": "fit: per-step terms",
                     "1x2 hierarchical": "held out", "1x8 hierarchical": "held out", "2x4 flat": "held out"}
    for r in rows:
        assert r["rel_err"] == pytest.approx(0.0, abs=1e-9), r["mesh"]
        assert r["rel_err"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1, abs=1e-15)
    # a record 10 % slower than the model shows up as -1/11 on the held-out side, and only there
    slow = [dict(r, sparse_fwdbwd_s=r["sparse_fwdbwd_s"] * 1.1) if r["mesh"] == "1x8" else r for r in recs]
    err = held_out_error(calibrate_traced(slow, fit=("syn", "1x4", "hierarchical"), intra=FAST)[0])
    assert err["lo"] == pytest.approx(1 / 1.1 - 1, rel=1e-9) and err["hi"] == pytest.approx(0.0, abs=1e-9)
    assert err["n"] == 3 and err["max_abs"] == pytest.approx(1 - 1 / 1.1, rel=1e-9)


def test_two_length_fit_recovers_fixed_and_per_row_terms_and_the_multi_gpu_host():
    """Records generated from costs with a fixed per-call part, a fixed + per-row per-step part and a
    multi-GPU host term unlike the one-GPU one, at two lengths: the two-length fit on the 1x4 records
    gives every term back, and the model reproduces the held-out meshes and lengths; the one-length fit
    (per-call cost assumed proportional to the rows, the one-GPU host term everywhere) does not."""
    true = dataclasses.replace(TRUE, call_fixed_s=0.4e-3, host_multi_s=5e-3)
    recs = [_synthetic(n, l, o, S=S, true=true) for S in (32768, 65536, 131072)
            for n, l, o in ((1, 1, "hierarchical"), (1, 4, "hierarchical"), (1, 2, "hierarchical"), (2, 2, "flat"))]
    fits = [("syn", "1x4", "hierarchical", 65536), ("syn", "1x4", "hierarchical", 131072)]
    rows, terms, costs = calibrate_traced(recs, fit=fits, intra=FAST)
    for f in ("call_fixed_s", "call_row_s", "step_fixed_s", "step_row_s", "host_multi_s"):
        assert terms[f] == pytest.approx(getattr(true, f), rel=1e-9), f
    got = costs["syn"]
    assert got.call_fixed_s == pytest.approx(true.call_fixed_s) and got.host(4) == pytest.approx(true.host_multi_s)
    assert got.host(1) == pytest.approx(got.host_s)
    roles = [r["role"] for r in rows]
    assert roles.count("fit: per-step terms") == 2 and roles.count("held out") == 7 and roles.count("fit: 1 GPU") == 3
    for r in rows:
        assert r["rel_err"] == pytest.approx(0.0, abs=1e-9), (r["S"], r["mesh"])
    one = held_out_error(calibrate_traced(recs, fit=fits[1], intra=FAST)[0])
    assert one["max_abs"] > 0.01
    with pytest.raises(ValueError, match="same length"):
        calibrate_traced(recs, fit=[fits[0], ("syn", "2x2", "flat", 65536)], intra=FAST)


def test_held_out_error_uses_only_held_out_rows():
    rows = [dict(role="fit: 1 GPU", rel_err=0.5), dict(role="fit: per-step terms", rel_err=-0.3),
            dict(role="held out", rel_err=0.04), dict(role="held out", rel_err=0.021),
            dict(role="held out", rel_err=-0.002)]
    assert held_out_error(rows) == dict(lo=-0.002, hi=0.04, max_abs=0.04, n=3)
    assert held_out_error(rows[:2]) == dict(lo=0.0, hi=0.0, max_abs=0.0, n=0)
    assert held_out_error([dict(role="held out", rel_err=0.07)]) == dict(lo=0.0, hi=0.07, max_abs=0.07, n=1)


def test_two_rank_fused_record_cannot_fit_the_per_call_cost():
    with pytest.raises(ValueError, match="not identifiable"):
        fit_step_terms(_synthetic(1, 1), _synthetic(1, 2))


def test_committed_h100_records_within_ten_percent():
    """The committed 4-GPU H100 measurements (runs v12a / v12): per-step terms from v12a 1x4
    only; the 2x2 records (both orders), v12a 1x2 and v12 1x4 are held out; every 2- and 4-GPU record
    within 10 %, the one-GPU records reproduced exactly."""
    recs = [r for r in read_records([RING]) if r.get("run") in ("v12a", "v12")]
    assert [r["run"] for r in recs] == ["v12a"] * 5 + ["v12"] * 2
    rows, terms, _ = calibrate_traced(recs, ("v12a", "1x4", "hierarchical"))
    assert (terms["run"], terms["mesh"], terms["P"]) == ("v12a", "1x4", 4)
    assert 9.0 < terms["per_call_ms_at_S"] < 11.0 and 1.5e-3 < terms["step_s"] < 2.5e-3
    held = {(r["run"], r["mesh"], r["ring_order"]) for r in rows if r["role"] == "held out"}
    assert held == {("v12a", "1x2", "hierarchical"), ("v12a", "2x2", "hierarchical"), ("v12a", "2x2", "flat"),
                    ("v12", "1x4", "hierarchical")}
    for r in rows:
        if r["mesh"] == "1x1":
            assert r["rel_err"] == pytest.approx(0.0, abs=1e-12)
        else:
            assert abs(r["rel_err"]) < 0.10, (r["run"], r["mesh"], r["rel_err"])
    # the earlier rate-only rule is 17-24 % optimistic on the same 4-GPU records (below)
    old = [r for r in calibrate(recs) if r["mesh"] in ("1x4", "2x2")]
    assert len(old) == 4 and all(-0.30 < r["rel_err"] < -0.12 for r in old)


def test_main_defaults_to_the_traced_records(tmp_path):
    assert main(["--out", str(tmp_path), "--earlier-records"]) == 0
    res = json.loads((tmp_path / "comm_model.json").read_text())
    assert {r["run"] for r in res["calibration"]} == {"v14"}
    assert res["model"]["current"] == "v14" and res["model"]["fit_record"]["run"] == "v14"
    sparse = {(r["S"], r["mesh"], r["ring_order"]): r for r in res["predictions"] if r["ring"] == "sparse"}
    for key in ((524288, "1x8", "hierarchical"), (524288, "2x4", "flat"), (1048576, "4x8", "hierarchical")):
        r = sparse[key]
        assert r["band_lo_s"] <= r["step_s"] <= r["band_hi_s"]
    assert sparse[(1048576, "4x8", "hierarchical")]["inter"] == "400G"
    assert sparse[(524288, "2x4", "flat")]["inter"] == "NVLink"
    assert (tmp_path / "comm_model.png").stat().st_size > 0
    assert "| v14 | 512K | 2x2 flat | held out |" in (tmp_path / "comm_model_current.md").read_text()
    assert {"commit", "code", "date", "command"} <= set(res["meta"]) and "--earlier-records" in res["meta"]["command"]


def test_main_keeps_the_older_records_usable(tmp_path):
    old = sorted({r["run"] for r in read_records([RING])} - {"v12a", "v12", "v14"})
    assert main(["--records", RING, "--runs", ",".join(old), "--earlier-records", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "comm_model.json").read_text())
    assert "calibration" not in res and len(res["earlier"]["calibration"]) > 30
    assert {"x4a", "v11"} <= {r["run"] for r in res["earlier"]["calibration"]}


def test_earlier_traced_family_checks_the_structure():
    """The same fit on an earlier traced family (x4c: H200, unfused calls, 4 GPUs at 256K and 512K):
    per-step terms from its 512K 1x4 trace only, every other record within 5 % -- the 256K ones at
    half the chunk too, where the per-step cost scaled with the chunk (the all-fixed form overshoots)."""
    recs = [r for r in read_records([RING]) if r.get("run") == "x4c"]
    rows, terms, _ = calibrate_traced(recs, ("x4c", "1x4", "hierarchical", 524288), intra=NVLINK_H200)
    assert terms["S"] == 524288 and 0.5 < terms["row_fraction"] < 0.9
    assert sum(r["role"] == "held out" for r in rows) == 7
    assert all(abs(r["rel_err"]) < 0.05 for r in rows)
    r = next(r for r in rows if (r["S"], r["mesh"], r["ring_order"]) == (262144, "1x4", "hierarchical"))
    fixed, chunk = (r["forms"][f] / r["measured_s"] - 1 for f in ("fixed", "chunk"))
    assert abs(chunk) < abs(r["rel_err"]) < abs(fixed) and fixed > 0.05


def test_current_h100_records_within_ten_percent():
    """Run v14 (the current code's 4-GPU H100 records, the default fit): per-step terms from its 1x4
    trace; 1x2 and both 2x2 orders held out; every 2- and 4-GPU record within 10 % (and optimistic: the
    multi-GPU host term is larger than the one-GPU record's), the one-GPU record reproduced exactly."""
    recs = [r for r in read_records([RING]) if r.get("run") == "v14" and r["S"] == 524288]
    rows, terms, _ = calibrate_traced(recs)
    assert (terms["run"], terms["mesh"], terms["P"]) == ("v14", "1x4", 4)
    assert 7.0 < terms["per_call_ms_at_S"] < 9.5 and 1.5e-3 < terms["step_s"] < 2.5e-3
    held = {(r["mesh"], r["ring_order"]) for r in rows if r["role"] == "held out"}
    assert held == {("1x2", "hierarchical"), ("2x2", "hierarchical"), ("2x2", "flat")}
    for r in rows:
        if r["mesh"] == "1x1":
            assert r["rel_err"] == pytest.approx(0.0, abs=1e-12)
        else:
            assert -0.10 < r["rel_err"] < 0.0, (r["mesh"], r["ring_order"], r["rel_err"])


def test_two_length_fit_on_the_committed_records():
    """Runs v14 (512K) and v15 (256K), the current code's 4-GPU H100 records, fit together (1x4 at both
    lengths) and held out against every other 2- and 4-GPU record of v14, v15 and v16 (128K, 256K): the
    per-call cost does not grow with the rows (1.3-1.9 ms a call at 128K-32K rows), and the held-out records at 256K
    and 512K are within 10 %, those at 128K are not (+14 % / +24 %: ``comm_model.md``)."""
    recs = [r for r in read_records([RING]) if r.get("run") in ("v14", "v15", "v16")]
    fits = [("v14", "1x4", "hierarchical", 524288), ("v15", "1x4", "hierarchical", 262144)]
    rows, terms, _ = calibrate_traced(recs, fits)
    call = lambda rows: terms["call_fixed_s"] + terms["call_row_s"] * rows  # noqa: E731
    assert terms["call_row_s"] <= 0 and all(1.0e-3 < call(rows) < 2.5e-3 for rows in (32768, 65536, 131072))
    assert 2e-3 < terms["host_multi_s"] < 6e-3
    held = {(r["run"], r["S"], r["mesh"], r["ring_order"]): r["rel_err"] for r in rows if r["role"] == "held out"}
    assert len(held) == 7
    assert all(abs(e) < 0.10 for (_, S, _, _), e in held.items() if S >= 262144), held
    assert 0.10 < held[("v16", 131072, "1x2", "hierarchical")] < 0.20
    assert 0.20 < held[("v16", 131072, "1x4", "hierarchical")] < 0.30
