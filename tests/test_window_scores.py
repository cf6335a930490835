"""The index estimate's Pallas Triton window kernels (``SparsityConfig.estimate_impl = "triton"``,
:mod:`pallas_kernels.window_scores`) against the XLA path: the same integer vertical and slash
scores, bit for bit, op by op in interpret mode on the CPU (GQA, packed documents, windows of one, two and a
quarter query block, head_dim 16-64); the sharded estimate on a 2x4 mesh equal to the XLA
single-device index; the kernels lower for CUDA with an IEEE division; bad settings named up front.
On a GPU (``pytest -m gpu``): the two paths' scores at 16K / 128K (a sequence and a per-document
window) differ by at most a few fixed-point units per window row (the platforms' ``exp``; jitted on a
CPU too: XLA's ``exp`` rounds differently inside a fusion), and the index of each path is the same in every program
(``tests/test_index_programs.py``)."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as Ps

from hypothesis import given, settings
from hypothesis import strategies as st

from mtraining_jax.layouts import Layout
from mtraining_jax.mesh import CP_AXES, make_mesh
from mtraining_jax.sparsity import SparsityConfig, estimate_index, estimate_index_shard
from mtraining_jax.sparsity import estimate as est
from mtraining_jax.sparsity import exact_logits
from pallas_kernels import window_scores as ws

CFG = SparsityConfig(vertical_min=4, vertical_max=64, slash_max=8, vertical_p=0.8, slash_p=0.8)


@functools.lru_cache(None)
def _qk(B, S, HQ, HKV, D, seed=0):
    kq, kk = jax.random.split(jax.random.PRNGKey(seed))
    q = jax.random.normal(kq, (B, S, HQ, D), jnp.float32) * 2.0
    k = jax.random.normal(kk, (B, S, HKV, D), jnp.float32) * 2.0
    k = k.at[:, 3].mul(4.0)  # a heavy key: a vertical line
    return q, k


def _kernel_bodies(jaxpr):
    """The kernel jaxprs of every ``pallas_call`` in ``jaxpr`` (a closed jaxpr or a jaxpr), nested
    calls included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn.params["jaxpr"]
            continue
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
                    yield from _kernel_bodies(sub)


def _kernel_conds(fn, *args) -> list[int]:
    """Per ``pallas_call`` of ``fn(*args)``: the ``cond`` s in its kernel."""
    return [str(b).count("cond[") for b in _kernel_bodies(jax.make_jaxpr(fn)(*args))]


def _segments(B, S, n):
    return jnp.asarray(np.repeat(np.arange(n), S // n)[None].repeat(B, 0), jnp.int32)


def _scores(q, k, pos, cfg, seg):
    ident = lambda x: x  # noqa: E731
    return jax.tree.map(np.asarray, est._local_scores(q, k, pos, q.shape[1], cfg, ident, ident, seg))


@pytest.mark.parametrize("last_q, segments, D, heads", [
    (64, False, 16, (4, 2)),  # one query block
    (128, True, 32, (4, 1)),  # two query blocks, packed documents, one KV head
    (16, False, 64, (2, 2)),  # a quarter of a block, no GQA
])
def test_kernel_scores_equal_the_xla_scores(last_q, segments, D, heads):
    B, S = 2, 1024
    q, k = _qk(B, S, *heads, D)
    cfg = dataclasses.replace(CFG, last_q=last_q)
    seg = _segments(B, S, 4) if segments else None
    lay = Layout("zigzag", S, 4)  # keys in a layout order: the kernels take positions in any order
    pos = jnp.asarray(lay.perm)
    args = (lay.permute(q), lay.permute(k), pos)
    lseg = None if seg is None else lay.permute(seg[..., None])[..., 0]
    kcfg = dataclasses.replace(cfg, estimate_impl="triton")
    ref = _scores(*args, cfg, lseg)
    got = _scores(*args, kcfg, lseg)
    ident = lambda x: x  # noqa: E731
    # the kernels ran (max, denominators, column sums); the sequence window's loops stay branch-free
    assert _kernel_conds(lambda *a: est._local_scores(*a, S, kcfg, ident, ident, lseg), *args) == [0, 0, 0]
    for name, a, b in zip(("vertical", "slash"), got, ref):
        assert a.dtype == b.dtype == np.int32 and a.shape == b.shape
        n = int((a != b).sum())
        assert n == 0, f"{name} scores differ in {n} entries"
    # real scores: every window row's probabilities sum to one (2^F units each), truncated below
    F, _ = est.fixed_point_bits(cfg)
    total = ref[0].astype(np.int64).sum(-1)
    assert np.all(total <= last_q * 2**F) and np.all(total > last_q * 2**F * (1 - 1e-4))
    # the slashes hold the same mass, up to the flooring of the low digits' sums (per key, per diagonal)
    assert np.all(np.abs(ref[1].astype(np.int64).sum(-1) - total) <= S)
    assert (ref[0] > 0).sum() > last_q  # many keys carry mass


def _documents(B, S, lengths):
    """``int32 [B, S]`` document ids from per-row ``lengths`` (``-1``: padding after the documents)."""
    out = np.full((B, S), -1, np.int32)
    for b, ls in enumerate(lengths):
        out[b, :sum(ls)] = np.repeat(np.arange(len(ls)), ls)
    return jnp.asarray(out)


@pytest.mark.parametrize("window_blocks, lengths", [
    # more documents than window blocks: the window keeps the last 4 blocks holding a document's end
    (4, [[60, 150, 30, 200, 72], [64, 32, 100, 250, 66]]),
    # fewer: padding window blocks (-1) and padding rows; padding tokens after the documents
    (8, [[300, 150], [500]]),
])
def test_kernel_scores_equal_the_xla_scores_per_document(window_blocks, lengths):
    """``window="per_document"``: the kernels take the window's scattered rows with their positions
    (padding rows see no key) and give the XLA path's integer scores bit for bit."""
    B, S = 2, 512
    q, k = _qk(B, S, 4, 2, 16, seed=1)
    seg = _documents(B, S, lengths)
    cfg = dataclasses.replace(CFG, last_q=32, window="per_document", window_blocks=window_blocks)
    lay = Layout("zigzag", S, 4)
    args = (lay.permute(q), lay.permute(k), jnp.asarray(lay.perm))
    lseg = lay.permute(seg[..., None])[..., 0]
    kcfg = dataclasses.replace(cfg, estimate_impl="triton")
    ref = _scores(*args, cfg, lseg)
    got = _scores(*args, kcfg, lseg)
    ident = lambda x: x  # noqa: E731
    # each pass skips the programs (live_programs) and the key tiles no window row sees (other documents')
    assert _kernel_conds(lambda *a: est._local_scores(*a, S, kcfg, ident, ident, lseg), *args) == [2, 2, 2]
    for name, a, b in zip(("vertical", "slash"), got, ref):
        assert a.dtype == b.dtype == np.int32 and a.shape == b.shape
        n = int((a != b).sum())
        assert n == 0, f"{name} scores differ in {n} entries"
    # real scores: each document's window rows (min(last_q, its length) of them, within the last
    # window_blocks blocks) carry one unit of probability each
    F, _ = est.fixed_point_bits(cfg)
    blocks, rows, _ = est._document_window(lseg, args[2], S, cfg, lambda x: x)
    n_rows = np.asarray(rows).sum(-1)  # [B]
    assert n_rows.min() >= 32
    total = ref[0].astype(np.int64).sum(-1)  # [B, Hq]
    assert np.all(total <= n_rows[:, None] * 2**F) and np.all(total > n_rows[:, None] * 2**F * (1 - 1e-4))
    if window_blocks == 8:
        assert (np.asarray(blocks) < 0).any()  # the padding window blocks were exercised


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_programs_without_a_visible_pair_skip_exactly(layout, monkeypatch):
    """With 64-key programs over 512 keys, most of the per-document window's programs see none of
    their rows' documents (``live_programs`` 0): they load nothing and write what their masked tiles
    would; the scores stay the XLA path's bit for bit (any layout)."""
    monkeypatch.setattr(ws, "KEY_CHUNK", 64)
    monkeypatch.setattr(ws, "KEY_TILE", 16)
    seen = []
    live_programs = ws.live_programs
    monkeypatch.setattr(ws, "live_programs", lambda *a: seen.append(np.asarray(live_programs(*a))) or live_programs(*a))
    B, S = 2, 512
    q, k = _qk(B, S, 4, 2, 16, seed=2)
    seg = _documents(B, S, [[60, 150, 30, 200, 72], [64, 32, 100, 250, 66]])
    cfg = dataclasses.replace(CFG, last_q=32, window="per_document", window_blocks=4)
    lay = Layout(layout, S, 4)
    args = (lay.permute(q), lay.permute(k), jnp.asarray(lay.perm))
    lseg = lay.permute(seg[..., None])[..., 0]
    ref = _scores(*args, cfg, lseg)
    got = _scores(*args, dataclasses.replace(cfg, estimate_impl="triton"), lseg)
    for name, a, b in zip(("vertical", "slash"), got, ref):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert len(seen) == 3 and all(x.shape == (B, 4, S // 64) for x in seen)  # a flag per pass and program
    dead = (seen[0] == 0).mean()
    assert 0.5 < dead < 1.0, dead  # most programs skip; the rest run
    assert ref[0].sum() > 0


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_live_programs_never_drop_a_visible_pair(data):
    """A program flagged dead has no (row, key) pair with ``k_pos <= q_pos`` (and equal document ids):
    any key order, padding rows (``-1``), any ids."""
    B, nrt, nkc, tr, kc = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4)), 4, 8
    R, Sk = nrt * tr, nkc * kc
    k_pos = np.asarray(data.draw(st.permutations(range(Sk))), np.int32)

    def ints(n, lo, hi):
        return np.asarray(data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)), np.int32)

    q_pos = ints(B * R, -1, Sk - 1).reshape(B, R)
    segs = data.draw(st.booleans())
    q_seg, k_seg = (ints(B * R, -1, 3).reshape(B, R), ints(B * Sk, -1, 3).reshape(B, Sk)) if segs else (None, None)
    ops = ws.WindowOperands(None, None, None, None, jnp.asarray(k_pos), None if q_seg is None else jnp.asarray(q_seg),
                            None if k_seg is None else jnp.asarray(k_seg), jnp.asarray(q_pos))
    live = np.asarray(ws.live_programs(ops, tr, kc))
    assert live.shape == (B, nrt, nkc) and set(np.unique(live)) <= {0, 1}
    vis = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, R, Sk]
    if segs:
        vis &= k_seg[:, None, :] == q_seg[:, :, None]
    per_program = vis.reshape(B, nrt, tr, nkc, kc).any(axis=(2, 4))
    assert not np.any(per_program & (live == 0))


@pytest.mark.parametrize("window", ["sequence", "per_document"])
def test_sharded_kernel_estimate_equals_the_xla_index(window):
    """``estimate_index_shard`` with the kernels on a 2x4 mesh (zigzag layout, packed documents, a
    window over two query blocks or every document's own last queries; ``check_vma=False`` as the
    library's shard_maps, else a named error): every rank's index equal to the XLA single-device one."""
    B, S, HQ, HKV, D = 2, 1024, 4, 2, 16
    q, k = _qk(B, S, HQ, HKV, D)
    seg = _segments(B, S, 2) if window == "sequence" else _documents(B, S, [[300, 200, 524], [1000]])
    cfg = dataclasses.replace(CFG, last_q=128 if window == "sequence" else 32, vertical_max=512,
                              vertical_p=(0.2, 0.4, 0.6, 0.8), window=window, window_blocks=4)
    ref = jax.tree.map(np.asarray, estimate_index(q, k, jnp.arange(S), cfg, segment_ids=seg))
    kcfg = dataclasses.replace(cfg, estimate_impl="triton")
    mesh = make_mesh((2, 4))
    seq = Ps(None, CP_AXES)

    def body(ql, kl, pos, sl):
        return jax.tree.map(lambda x: x[None], estimate_index_shard(ql, kl, pos, kcfg, CP_AXES, segment_ids=sl))

    lay = Layout("zigzag", S, 8)
    args = (lay.permute(q), lay.permute(k), jnp.asarray(lay.perm), lay.permute(seg[..., None])[..., 0])
    specs = dict(mesh=mesh, in_specs=(seq, seq, Ps(CP_AXES), seq), out_specs=Ps(CP_AXES))
    with pytest.raises(ValueError, match="check_vma=False"):  # its Pallas calls carry no varying-axes types
        jax.jit(jax.shard_map(body, **specs))(*args)
    out = jax.jit(jax.shard_map(body, check_vma=False, **specs))(*args)
    # "auto" (here as on a GPU) inside a check_vma=True shard_map takes the XLA path instead of failing
    acfg = dataclasses.replace(cfg, estimate_impl="auto")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax, "default_backend", lambda: "gpu")
        auto = jax.jit(jax.shard_map(lambda *a: jax.tree.map(lambda x: x[None], estimate_index_shard(
            *a[:3], acfg, CP_AXES, segment_ids=a[3])), **specs))(*args)
    for field, a, b in zip(ref._fields, auto, ref):
        np.testing.assert_array_equal(np.asarray(a), np.broadcast_to(b[None], a.shape), err_msg=field)
    for field, a, b in zip(ref._fields, out, ref):
        np.testing.assert_array_equal(np.asarray(a), np.broadcast_to(b[None], a.shape), err_msg=field)
    counts = ref.v_count
    assert counts.min() >= 4 and counts.max() < 512 and len(set(counts.ravel().tolist())) > 1  # a real index


def _operands(B, S, HQ, HKV, D, R):
    q = jnp.zeros((B, R, HQ, D), jnp.float32)
    k = jnp.zeros((B, S, HKV, D), jnp.float32)
    qd, kd = exact_logits.operand_digits(q), exact_logits.operand_digits(k)
    return ws.WindowOperands(qd.digits, qd.row_scale, kd.digits, kd.row_scale, jnp.arange(S, dtype=jnp.int32))


@pytest.mark.parametrize("documents", [False, True])
def test_kernels_lower_for_cuda_with_an_ieee_division(documents):
    """The three passes lower to Triton for CUDA (at the training shape: 14/2 heads, d64, 64 rows,
    a 4K-key shard; with documents: the per-document window's row positions, document ids and the
    branch that skips key tiles no row sees); the probabilities divide with ``div.rn.f32`` on float
    registers (Triton's own ``/`` is ``div.full.f32``, 2 ulp)."""
    ops = _operands(1, 4096, 14, 2, 64, 64)
    first = 4096 - 64
    if documents:
        ids = jnp.zeros((1, 4096), jnp.int32)
        ops = ops._replace(q_seg=ids[:, :64], k_seg=ids, q_pos=jnp.arange(64, dtype=jnp.int32)[None] * 64)
        first = None
    m = jnp.zeros((1, 14, 64), jnp.float32)
    kw = dict(first=first, w=8, block_size=64, interpret=False)
    fns = {
        "row_max": lambda o: ws.row_max(o, **kw),
        "exp_digit_sums": lambda o, m: ws.exp_digit_sums(o, m, scale=0.125, widths=est._E_DIGITS, **kw),
        "column_digit_sums": lambda o, m: ws.column_digit_sums(o, m, m, scale=0.125, widths=(23, 7), **kw),
    }
    for name, f in fns.items():
        args = (ops,) if name == "row_max" else (ops, m)
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text, name
        assert text.count("div.rn.f32") == text.count("=f,f,f") == (name == "column_digit_sums"), name


def test_bf16_operands_score_as_their_float32_values():
    """The estimate's digits of a bf16 operand are those of its float32 value (a bf16 row max's bits
    were once read as a narrower integer and broke the broadcast): both score paths, bit for bit."""
    S = 512
    q, k = _qk(1, S, 4, 2, 16, seed=5)
    q, k = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
    pos = jnp.arange(S, dtype=jnp.int32)
    for impl in ("xla", "triton"):
        cfg = dataclasses.replace(CFG, estimate_impl=impl)
        got = _scores(q, k, pos, cfg, None)
        want = _scores(q.astype(jnp.float32), k.astype(jnp.float32), pos, cfg, None)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        assert got[0].sum() > 0


def test_tiles_and_supported_shapes(monkeypatch):
    assert ws.row_tile(64, 64) == 64 and ws.row_tile(1024, 64) == 64 and ws.row_tile(16, 64) == 16
    assert ws.row_tile(64, 32) == 32  # a row tile never straddles a query block
    assert ws._key_chunk(131072, 64, 3, 64) == (1024, 64) and ws._key_chunk(3 * 64, 64, 3, 64) == (64, 64)
    assert ws._key_chunk(131072, 64, 3, 128) == (1024, 64)
    # the shared memory the H200's compiler asked for (RESOURCE_EXHAUSTED messages): key tile 128, 2 stages,
    # d128 -> 246,272 bytes; key tile 256, 3 stages, d64 -> 323,584: the bound is at most 1 % above
    monkeypatch.setattr(ws, "KEY_TILE", 128)
    monkeypatch.setattr(ws, "KEY_CHUNK", 2048)
    assert 246272 <= ws.smem_bytes(128, 64, 3, 128) <= 246272 * 1.01
    assert ws._key_chunk(131072, 64, 3, 128) == (2048, 64) and ws._key_chunk(131072, 64, 3, 64) == (2048, 128)
    monkeypatch.setattr(ws, "NUM_STAGES", 3)
    assert 323584 <= ws.smem_bytes(256, 64, 3, 64) <= 323584 * 1.01
    monkeypatch.setattr(ws, "KEY_TILE", 256)
    assert ws.smem_bytes(256, 64, 3, 64) > ws.SMEM_BYTES and ws._key_chunk(131072, 64, 3, 64) == (2048, 128)
    ws.supports(64, 131072, 64)
    for args, what in [((48, 1024, 64), "last_q"), ((64, 1024, 80), "head_dim"), ((64, 1000, 64), "keys")]:
        with pytest.raises(NotImplementedError, match=what):
            ws.supports(*args)


def test_key_tile_fits_each_gpus_shared_memory(monkeypatch):
    """The key tile is halved to fit the device's opt-in shared memory per block, looked up by compute
    capability (an A100 163 KiB, an RTX 4090 / L40 99 KiB, Hopper 227 KiB; unknown: the smallest)."""
    assert ws.smem_limit() == ws.SMEM_BYTES  # this CPU (interpret mode)
    for cc, limit, d64, d128 in [("9.0", 232448, 64, 64), ("8.0", 166912, 64, 64), ("8.9", 101376, 64, 32),
                                 ("11.0", 65536, 32, 16)]:
        monkeypatch.setattr(ws, "compute_capability", lambda cc=cc: cc)
        assert ws.smem_limit() == limit, cc
        assert ws._key_chunk(131072, 64, 3, 64) == (1024, d64) and ws._key_chunk(131072, 64, 3, 128)[1] == d128, cc
        if d128 > 16:
            assert ws.smem_bytes(d128, 64, 3, 128) <= limit < ws.smem_bytes(2 * d128, 64, 3, 128) or d128 == ws.KEY_TILE


def test_auto_picks_the_kernels_on_a_gpu_only(monkeypatch):
    cfg = dataclasses.replace(CFG, estimate_impl="auto")
    assert est.estimate_impl(cfg, 4096, 64) == "xla"  # this CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert est.estimate_impl(cfg, 4096, 64) == "triton"
    assert est.estimate_impl(cfg, 4096, 80) == "xla"  # a head_dim the kernels do not take
    assert est.estimate_impl(dataclasses.replace(cfg, last_q=48), 4096, 64) == "xla"
    doc = dataclasses.replace(cfg, window="per_document", window_blocks=64)
    assert est.estimate_impl(doc, 4096, 64) == "triton"  # the per-document window too
    assert est.estimate_impl(doc, 4096, 64, rows=3 * 64) == "xla"  # window rows the kernels do not take
    assert est.estimate_impl(dataclasses.replace(doc, estimate_impl="xla"), 4096, 64) == "xla"
    assert est.estimate_impl(dataclasses.replace(cfg, estimate_impl="xla"), 4096, 64) == "xla"
    assert est.estimate_impl(cfg, 4096, 64, varying=True) == "xla"  # in a shard_map with check_vma=True


def test_bad_estimate_impl_settings_are_named_up_front():
    with pytest.raises(ValueError, match="estimate_impl='cuda'"):
        SparsityConfig(estimate_impl="cuda")
    SparsityConfig(estimate_impl="triton", window="per_document")  # 64 x 64 window rows
    with pytest.raises(ValueError, match="window_blocks x block_size a power of two, got 3 x 64"):
        SparsityConfig(estimate_impl="triton", window="per_document", window_blocks=3)
    with pytest.raises(ValueError, match="last_q a power of two >= 16, got 48"):
        SparsityConfig(estimate_impl="triton", last_q=48)
    q, k = _qk(1, 1024, 2, 1, 16)
    cfg = dataclasses.replace(CFG, estimate_impl="triton")
    q3, k3 = _qk(1, 192, 2, 1, 16)  # 3 query blocks: a per-document window of 3 x 64 rows
    with pytest.raises(ValueError, match=r"window rows \(last_q, or window_blocks x block_size\) a power of two >= 16, "
                                         r"got 192"):
        estimate_index(q3, k3, jnp.arange(192), dataclasses.replace(cfg, window="per_document", last_q=32),
                       segment_ids=jnp.zeros((1, 192), jnp.int32))
    with pytest.raises(ValueError, match="head_dim a power of two >= 16, got 24"):
        estimate_index(q[..., :24].repeat(2, -1)[..., :24], k[..., :24].repeat(2, -1)[..., :24], jnp.arange(1024), cfg)


def _compare_compiled(S, window, heads=(14, 2)):
    """The two score paths jitted, at ``S`` with bf16 q/k, head_dim 64, ``last_q`` 64 (``per_document``:
    24 documents, window of ``min(64, S / 64)`` blocks of 64 rows). Compiled, the platforms' ``exp``
    may round differently (on a GPU the kernels' is libdevice's; XLA's CPU ``exp`` inside a fusion is
    not its ``exp`` alone): a probability ``a <= 1`` then moves by a few ``2^-24 a``, a few units of
    the ``2^-F`` fixed point per window row, so the integer scores of the two paths differ by at most
    ``4`` units per window row and key (``4 block_size`` per row and slash); the kernel path is
    deterministic (two runs equal) and its total mass is the window rows' less what the fixed point drops."""
    HQ, HKV = heads
    D, lq = 64, 64
    q, k = _qk(1, S, HQ, HKV, D, seed=3)
    q, k = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
    pos = jnp.arange(S, dtype=jnp.int32)
    seg = None if window == "sequence" else jnp.asarray(np.repeat(np.arange(24), -(-S // 24))[None, :S], jnp.int32)
    cfg = SparsityConfig(last_q=lq, estimate_impl="xla", window=window)
    rows = cfg.window_rows_at(S)
    run = lambda c: jax.jit(lambda a, b: est._local_scores(a, b, pos, S, c, lambda x: x, lambda x: x, seg))  # noqa: E731
    ref = jax.tree.map(np.asarray, run(cfg)(q, k))
    kern = run(dataclasses.replace(cfg, estimate_impl="triton"))
    got = jax.tree.map(np.asarray, kern(q, k))
    again = jax.tree.map(np.asarray, kern(q, k))
    for a, b in zip(got, again):
        np.testing.assert_array_equal(a, b)
    diff_v, diff_s = (np.abs(a.astype(np.int64) - b) for a, b in zip(got, ref))
    print(f"S={S} {window}: vertical scores differ in {(diff_v > 0).sum()} of {diff_v.size} (max {diff_v.max()}), "
          f"slash in {(diff_s > 0).sum()} of {diff_s.size} (max {diff_s.max()})")
    assert diff_v.max() <= 4 * rows and diff_s.max() <= 4 * rows * cfg.block_size
    F, G = est.fixed_point_bits(cfg)
    total = got[0].astype(np.int64).sum(-1)
    n = lq if seg is None else 24 * lq  # window rows that see keys: every document's last 64
    # each row's mass is 2^F units of 2^-F, less what the fixed point drops: each probability truncated
    # to F + G bits (< S / 2^G units per row), their float32 rounding (< 1 unit per row), each vertical
    # score floored to 2^-F (< 1 unit per key: at 128K keys ~65K units, 1.2e-4 of a 64-row window's mass)
    lost = n * (S / 2**G + 1) + S
    assert np.all(total <= n * 2**F) and np.all(total > n * 2**F - lost), (total, n * 2**F, lost)


def test_compiled_paths_differ_at_most_in_the_last_bit_on_the_cpu():
    """Jitted on this CPU the XLA path's ``exp`` rounds differently inside its fusion (not op by op):
    the bound the GPU test checks holds here too."""
    _compare_compiled(1024, "sequence", heads=(4, 2))


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("S, window", [(16384, "sequence"), (131072, "sequence"), (131072, "per_document")])
def test_kernel_scores_against_the_xla_scores_on_a_gpu(S, window):
    """:func:`_compare_compiled` on a GPU (``per_document``: 24 documents, 64 window blocks)."""
    _compare_compiled(S, window)


def test_estimate_impl_is_reachable_from_a_config():
    """``model.sparsity.estimate_impl`` in a YAML or an override selects the kernels; a bad value is
    named when the model config is built."""
    from mtraining_jax.train.config import load_config
    from mtraining_jax.train.state import build_model_config

    def impl(*overrides):
        return build_model_config(load_config("configs/tiny_cpu.yaml", list(overrides)).model, "configs")[1] \
            .mtraining_config().sparsity.estimate_impl

    assert impl("model.sparsity.estimate_impl=triton") == "triton" and impl() == "auto"
    with pytest.raises(ValueError, match="estimate_impl='cuda'"):
        impl("model.sparsity.estimate_impl=cuda")


def test_window_tiles_benchmark_rows(tmp_path, capsys):
    """``benchmarks/window_tiles.py`` at toy size: a row per (tiling, pass) and the XLA estimate, every
    tiling's index the XLA path's (interpret mode), the module's tiling restored; bad tilings named."""
    from benchmarks import window_tiles

    out = tmp_path / "rows.jsonl"
    before = (ws.KEY_TILE, ws.KEY_CHUNK, ws.NUM_WARPS, ws.NUM_STAGES)
    assert window_tiles.main(["--seq", "512", "--heads", "2,1", "--head-dim", "16", "--last-q", "32", "--tiles",
                              "128:256:4:2,64:512:8:3", "--rounds", "1", "--repeats", "1", "--out", str(out)]) == 0
    assert (ws.KEY_TILE, ws.KEY_CHUNK, ws.NUM_WARPS, ws.NUM_STAGES) == before
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["fn"], r["tiling"]) for r in rows][:2] == [("estimate", None), ("row_max", "128:256:4:2")]
    assert len(rows) == 9 and all(r["S"] == 512 and r["device"] == "cpu" and r["ms"] > 0 for r in rows)
    assert [r["index_diff"] for r in rows if r["fn"] == "estimate"] == [0, 0, 0]
    assert [r["key_tile"] for r in rows if r["fn"] == "estimate" and r["tiling"]] == [128, 64]


def test_window_tiles_reports_a_tiling_that_fails_and_goes_on(tmp_path, monkeypatch):
    """A tiling whose kernels do not compile (on a GPU: more shared memory than it has) gets a row with
    the error; the other tilings are still timed; every tiling failing exits 1."""
    from benchmarks import window_tiles

    real = ws.row_max

    def row_max(*args, **kw):
        if ws.NUM_STAGES == 3:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested 9")
        return real(*args, **kw)

    monkeypatch.setattr(ws, "row_max", row_max)
    out = tmp_path / "rows.jsonl"
    argv = ["--seq", "512", "--heads", "2,1", "--head-dim", "16", "--last-q", "32", "--rounds", "1", "--repeats", "1",
            "--out", str(out)]
    assert window_tiles.main(argv + ["--tiles", "64:256:4:3,64:256:4:2"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    bad = [r for r in rows if r["tiling"] == "64:256:4:3"]
    assert len(bad) == 1 and "RESOURCE_EXHAUSTED" in bad[0]["error"] and "ms" not in bad[0]
    assert len([r for r in rows if r["tiling"] == "64:256:4:2" and r["ms"] > 0]) == 4
    assert window_tiles.main(argv + ["--tiles", "64:256:4:3"]) == 1


def test_window_tiles_rejects_bad_arguments(capsys):
    from benchmarks import window_tiles

    for argv, msg in [(["--tiles", "100:256:4:2"], "powers of two"), (["--tiles", "128:4096:4:2", "--seq", "2048"],
                                                                      "KEY_CHUNK 4096 does not divide"),
                      (["--last-q", "48"], "last_q"), (["--heads", "3,2"], "KV dividing QUERY")]:
        with pytest.raises(SystemExit):
            window_tiles.main(argv)
        assert msg in capsys.readouterr().err
