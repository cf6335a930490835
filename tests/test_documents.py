"""Packed documents (issue 21): segment ids from the data to the kernels; every path equals the
float32 dense reference with the block-diagonal causal document mask."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mtraining_jax.attention.dispatch import attention
from mtraining_jax.attention.mtraining import MTrainingConfig, mtraining_attention
from pallas_kernels.reference import dense_attention
from mtraining_jax.ring.attention import ring_attention
from mtraining_jax.ring.config import RingOptions
from mtraining_jax.layouts import Layout
from mtraining_jax.mesh import make_mesh
from mtraining_jax.sparsity import SparsityConfig, estimate_index
from mtraining_jax.sparsity.masks import index_to_mask
from mtraining_jax.train.config import DataConfig
from mtraining_jax.train.data import PackedLoader, document_segments
from pallas_kernels.api import block_sparse_attention
from pallas_kernels.index_format import apply_segments, full_step_index

B, HQ, HKV, D = 2, 4, 2, 32


def _qkv(seed, S):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (B, S, HQ, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, S, HKV, D), jnp.float32).at[:, 3].mul(4.0)
    v = jax.random.normal(ks[2], (B, S, HKV, D), jnp.float32)
    return q, k, v, jax.random.normal(ks[3], (B, S, HQ, D), jnp.float32)


def _segments(lengths_per_row, S):
    """``int32 [B, S]`` from document lengths per row (the last document fills the row)."""
    seg = np.zeros((len(lengths_per_row), S), np.int32)
    for b, lens in enumerate(lengths_per_row):
        ends = np.cumsum(lens)
        seg[b] = np.searchsorted(ends, np.arange(S), side="right")
    return jnp.asarray(seg)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _value_and_grads(fn, q, k, v, cot):
    def f(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * cot), out

    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def _assert_close(got, want, tol=1e-5):
    (out, grads), (rout, rgrads) = got, want
    assert _rel(out, rout) <= tol
    for g, r in zip(grads, rgrads):
        assert _rel(g, r) <= tol


def _reference(seg, mask=None):
    return lambda q, k, v: dense_attention(q, k, v, mask=mask, q_seg=seg, k_seg=seg)[0]


# documents shorter than a block (5, 9), exactly on block boundaries (64), longer than a rank's share
# of S = 512 over 4 ranks (300), one document (the degenerate case)
DOCS = [[[5, 9, 50, 64, 64, 300]], [[64, 64, 128]], [[300]], [[1, 2, 3, 700]]]


# ----------------------------------------------------------------------------------- data


def test_document_segments_and_positions():
    eos = 9
    x = np.array([[1, 2, eos, 3, eos, eos, 4, 5]])
    seg, pos = document_segments(x, eos)
    np.testing.assert_array_equal(seg, [[0, 0, 0, 1, 1, 2, 3, 3]])
    np.testing.assert_array_equal(pos, [[0, 1, 2, 0, 1, 0, 0, 1]])


@pytest.mark.parametrize("positions", ["global", "per_document"])
def test_loader_documents_travel_with_layout(positions):
    eos, S = 0, 128
    rng = np.random.default_rng(0)
    stream = rng.integers(1, 50, size=4 * S + 1).astype(np.int32)
    stream[rng.choice(len(stream), 20, replace=False)] = eos
    layout = Layout("block_striped", S, 4, stripe=16)
    kw = dict(seq_len=S, batch_size=2, layout=layout, shuffle=False, eos_id=eos)
    docs = next(PackedLoader(stream, pack="documents", positions=positions, **kw))
    plain = next(PackedLoader(stream, **kw))
    np.testing.assert_array_equal(docs.tokens, plain.tokens)  # same windows, same layout
    tokens = layout.unpermute(docs.tokens, axis=-1)
    seg, pos = document_segments(tokens, eos)
    np.testing.assert_array_equal(layout.unpermute(docs.segment_ids, axis=-1), seg)
    # the label of an eos input is the next document's first token: not counted
    np.testing.assert_array_equal(layout.unpermute(docs.mask, axis=-1), (tokens != eos).astype(np.float32))
    if positions == "per_document":
        np.testing.assert_array_equal(layout.unpermute(docs.rope_positions, axis=-1), pos)
    else:
        assert docs.rope_positions is None
    assert plain.segment_ids is None


def test_data_config_rejects_bad_packing():
    with pytest.raises(ValueError, match="data.pack must be one of"):
        DataConfig(pack="docs")
    with pytest.raises(ValueError, match="per_document.*needs data.pack='documents'"):
        DataConfig(positions="per_document")


# ----------------------------------------------------------------------------------- kernels


def test_apply_segments_drops_and_flags_tiles():
    bs, S = 16, 64
    seg = _segments([[16, 8, 40]], S)[:1]  # segments per block of 16: {0}, {1, 2}, {2}, {2}
    pos = jnp.arange(S, dtype=jnp.int32)
    idx = apply_segments(full_step_index(1, 1, S, S, pos, pos, bs), seg, seg, bs)
    rows = [sorted(np.asarray(idx.block_idx[0, 0, i, :idx.block_count[0, 0, i]]).tolist()) for i in range(4)]
    assert rows == [[0], [1], [1, 2], [1, 2, 3]]  # block 0 (document 0 only) seen by row 0 only
    flags = {(i, int(j)): int(f) for i in range(4)
             for j, f in zip(idx.block_idx[0, 0, i, :idx.block_count[0, 0, i]], idx.block_causal[0, 0, i])}
    assert flags[(3, 3)] == 1 and flags[(0, 0)] == 1  # diagonal tiles: causal mask
    assert flags[(3, 2)] == 0 and flags[(2, 1)] == 1  # inside one document: free; straddling: masked


@settings(max_examples=4, deadline=None)
@given(st.lists(st.integers(1, 150), min_size=1, max_size=6), st.sampled_from([16, 32]))
def test_kernel_api_documents_match_reference(lens, bs):
    S = 256
    q, k, v, cot = _qkv(len(lens) + bs, S)
    seg = _segments([lens, lens[::-1]], S)
    fn = lambda q, k, v: block_sparse_attention(q, k, v, block_size=bs, impl="xla", q_seg=seg, k_seg=seg)  # noqa: E731
    _assert_close(_value_and_grads(fn, q, k, v, cot), _value_and_grads(_reference(seg), q, k, v, cot))


def test_segment_errors_are_clear():
    q, k, v, _ = _qkv(0, 64)
    seg = jnp.zeros((B, 64), jnp.int32)
    with pytest.raises(ValueError, match="give both q_seg and k_seg"):
        block_sparse_attention(q, k, v, block_size=16, impl="xla", q_seg=seg)
    with pytest.raises(ValueError, match=r"q_seg has shape \(2, 32\)"):
        block_sparse_attention(q, k, v, block_size=16, impl="xla", q_seg=seg[:, :32], k_seg=seg)
    with pytest.raises(NotImplementedError, match="cudnn backend has no document"):
        attention(q, k, v, jnp.arange(64), backend="cudnn", segment_ids=seg)
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[B, S\]"):
        attention(q, k, v, jnp.arange(64), backend="reference", segment_ids=seg[0])


# ----------------------------------------------------------------------------------- rings


@pytest.mark.parametrize("docs,mesh_shape,layout_name,order,side",
                         [(DOCS[0], (2, 2), "block_striped", "hierarchical", "kv"),
                          (DOCS[1], (1, 4), "zigzag", "flat", "kv"),
                          (DOCS[1], (2, 2), "zigzag", "hierarchical", "query")])  # visiting queries' segments
def test_dense_ring_documents(docs, mesh_shape, layout_name, order, side):
    S = 512
    q, k, v, cot = _qkv(1, S)
    seg = _segments(docs * B, S)
    mesh = make_mesh(mesh_shape, jax.devices()[:4])
    lay = Layout(layout_name, S, 4, stripe=64)
    p = lay.permute

    def fn(q, k, v):
        out = ring_attention(p(q), p(k), p(v), lay.perm, mesh, ring_order=order, impl="xla",
                             segment_ids=lay.permute(seg, axis=-1), backward_ring=side)
        return lay.unpermute(out)

    _assert_close(_value_and_grads(fn, q, k, v, cot), _value_and_grads(_reference(seg), q, k, v, cot))


SPARSE = SparsityConfig(vertical_p=0.6, slash_p=0.6, vertical_min=4, vertical_max=24, slash_min=1, slash_max=4)


@pytest.mark.parametrize("docs, window, side, exchange", [
    (DOCS[0], "sequence", "kv", "ring"), (DOCS[3], "sequence", "kv", "ring"), (DOCS[3], "sequence", "query", "ring"),
    (DOCS[0], "per_document", "kv", "ring"), (DOCS[3], "sequence", "kv", "sparse")])
def test_sparse_ring_documents_match_masked_reference(docs, window, side, exchange):
    """The sparse ring with documents = dense reference under (index mask AND document mask), the
    index being the one estimated under the document mask (from the sequence's last queries or
    every document's own)."""
    S = 512
    q, k, v, cot = _qkv(2, S)
    seg = _segments(docs * B, S)
    mesh = make_mesh((2, 2), jax.devices()[:4])
    sparse = dataclasses.replace(SPARSE, window=window, window_blocks=4)
    cfg = MTrainingConfig(sparsity=sparse, ring=RingOptions(impl="xla", backward_ring=side, kv_exchange=exchange))
    lay = cfg.make_layout(S, 4)
    p = lay.permute

    def fn(q, k, v):
        return lay.unpermute(mtraining_attention(p(q), p(k), p(v), mesh, cfg, segment_ids=p(seg, axis=-1)))

    index = estimate_index(q, k, jnp.arange(S, dtype=jnp.int32), sparse, segment_ids=seg)
    mask = index_to_mask(index, S, SPARSE.block_size)
    _assert_close(_value_and_grads(fn, q, k, v, cot), _value_and_grads(_reference(seg, mask), q, k, v, cot))


def test_documents_cut_sparse_work():
    """Tiles across a boundary are skipped: the executed work shrinks with the documents, and a
    full index through the sparse machinery is exact under the document mask."""
    S = 512
    q, k, v, cot = _qkv(3, S)
    seg = _segments(DOCS[1] * B, S)
    mesh = make_mesh((1, 4), jax.devices()[:4])
    cfg = MTrainingConfig(sparsity=SPARSE, ring=RingOptions(impl="xla", ring_order="flat"), force_full=True)
    lay = cfg.make_layout(S, 4)
    p = lay.permute
    run = jax.jit(lambda q, k, v, s: mtraining_attention(q, k, v, mesh, cfg, segment_ids=s, return_stats=True))
    _, stream = run(p(q), p(k), p(v), None)
    out, docs = run(p(q), p(k), p(v), p(seg, axis=-1))
    # 64 + 64 + 128 + 256 tokens in blocks of 64: 1 + 1 + 3 + 10 of the 36 causal tiles
    assert float(np.sum(docs.work)) / float(np.sum(stream.work)) == pytest.approx(15 / 36)
    np.testing.assert_allclose(lay.unpermute(out), _reference(seg)(q, k, v), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------- model


def test_model_packed_documents_equal_separate_runs():
    """Two documents packed with per-document RoPE positions give, token for token, the hidden
    states of each document run alone."""
    from flax import nnx

    from mtraining_jax.model.config import ModelConfig
    from mtraining_jax.model.qwen2 import Qwen2ForCausalLM

    cfg = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, rope_theta=1e4, max_position_embeddings=512, initializer_range=0.2,
                      attention_backend="reference", dtype="float32", param_dtype="float32")
    model = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(4), (1, 48), 0, 96)
    seg = _segments([[20, 28]], 48)[:1]
    doc_pos = jnp.concatenate([jnp.arange(20), jnp.arange(28)])[None]
    packed = model(tokens, jnp.arange(48), segment_ids=seg, rope_positions=doc_pos)
    first = model(tokens[:, :20], jnp.arange(20))
    second = model(tokens[:, 20:], jnp.arange(28))
    np.testing.assert_allclose(packed, jnp.concatenate([first, second], axis=1), rtol=2e-5, atol=2e-5)


def test_recall_with_documents_matches_dense_document_mask():
    """``metrics.recall(..., segment_ids=)``: mean over rows of the causal document-masked softmax
    mass kept by the index, against the dense computation; documents change it."""
    from pallas_kernels.reference import attention_logits
    from mtraining_jax.sparsity import metrics

    S, bs = 256, 32
    q, k, _, _ = _qkv(7, S)
    seg = _segments([[5, 60, 100], [200]], S)
    index = estimate_index(q, k, jnp.arange(S, dtype=jnp.int32), SparsityConfig(
        block_size=bs, vertical_min=1, vertical_max=16, slash_max=3), segment_ids=seg)
    t = jnp.arange(S)
    ok = (t[None, :] <= t[:, None])[None, None] & (seg[:, :, None] == seg[:, None, :])[:, None]
    p = jax.nn.softmax(jnp.where(ok, attention_logits(q, k), -jnp.inf), axis=-1)
    want = np.asarray(jnp.where(index_to_mask(index, S, bs) & ok, p, 0.0).sum(-1).mean(-1), np.float64)
    got = metrics.recall(q, k, index, block_size=bs, chunk=128, segment_ids=seg)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert np.all(np.abs(got - metrics.recall(q, k, index, block_size=bs, chunk=128)) > 1e-3)


# ----------------------------------------------------------------------------------- per-document window


def test_document_window_rows():
    """The per-document observation window: each document's own last ``last_q`` tokens, in the
    last ``window_blocks`` query blocks that hold any (the rows of those blocks outside a window
    masked), padding blocks -1."""
    from mtraining_jax.sparsity.estimate import _document_window

    S, bs, lq = 256, 16, 8
    seg = _segments([[5, 30, 100, 121], [256]], S)
    ident = lambda x: x  # noqa: E731
    for wb in (3, 16, 32):  # 32: more window blocks than the sequence has (capped at S / bs)
        cfg = SparsityConfig(block_size=bs, last_q=lq, window="per_document", window_blocks=wb)
        blocks, rows, row_seg = (np.asarray(x) for x in _document_window(seg, jnp.arange(S), S, cfg, ident))
        # the rows the estimate scores at this length (one definition: the config's), at most the bound
        assert blocks.shape[1] * bs == cfg.window_rows_at(S) == min(wb, S // bs) * bs <= cfg.window_rows == wb * bs
        assert SparsityConfig(last_q=lq).window_rows_at(S) == SparsityConfig(last_q=lq).window_rows == lq
        for b in range(2):
            s = np.asarray(seg[b])
            ends = np.r_[np.nonzero(np.diff(s))[0] + 1, S]
            win = np.nonzero(np.arange(S) >= ends[s] - lq)[0]
            want = sorted(set(win // bs), reverse=True)[:wb]
            got = blocks[b][blocks[b] >= 0]
            assert got.tolist() == want
            tok = (np.maximum(blocks[b], 0)[:, None] * bs + np.arange(bs)).ravel()
            np.testing.assert_array_equal(rows[b], (np.repeat(blocks[b], bs) >= 0) & np.isin(tok, win))
            np.testing.assert_array_equal(row_seg[b], s[tok])
    with pytest.raises(ValueError, match="window='docs'"):
        SparsityConfig(window="docs")
    with pytest.raises(ValueError, match="window_blocks"):
        SparsityConfig(window_blocks=0)


PER_DOC = SparsityConfig(vertical_p=0.8, slash_p=0.8, vertical_min=4, vertical_max=48, slash_max=6,
                         window="per_document", window_blocks=6)


@pytest.mark.parametrize("layout_name", ["block_striped"])
def test_per_document_estimate_sharded_equals_single_device(layout_name):
    """Bit-identical index on every rank of a 2x2 mesh, in any layout, and different from the
    sequence window's (the earlier documents' verticals are found)."""
    from jax.sharding import PartitionSpec as Ps

    from mtraining_jax.mesh import CP_AXES
    from mtraining_jax.sparsity import estimate_index_shard

    S = 512
    q, k, _, _ = _qkv(3, S)
    seg = _segments([[5, 9, 50, 64, 64, 300], [100, 412]], S)
    ref = estimate_index(q, k, jnp.arange(S, dtype=jnp.int32), PER_DOC, segment_ids=seg)
    mesh = make_mesh((2, 2), jax.devices()[:4])
    seq = Ps(None, CP_AXES)
    f = jax.jit(jax.shard_map(
        lambda ql, kl, pos, sl: jax.tree.map(lambda x: x[None], estimate_index_shard(
            ql, kl, pos, PER_DOC, CP_AXES, segment_ids=sl)),
        mesh=mesh, in_specs=(seq, seq, Ps(CP_AXES), seq), out_specs=Ps(CP_AXES)))
    lay = Layout(layout_name, S, 4, stripe=16)
    out = f(lay.permute(q), lay.permute(k), jnp.asarray(lay.perm), lay.permute(seg, axis=-1))
    for a, b in zip(out, ref):
        np.testing.assert_array_equal(np.asarray(a), np.broadcast_to(np.asarray(b)[None], a.shape))
    seq_idx = estimate_index(q, k, jnp.arange(S, dtype=jnp.int32),
                             dataclasses.replace(PER_DOC, window="sequence"), segment_ids=seg)
    assert not np.array_equal(np.asarray(seq_idx.v_idx), np.asarray(ref.v_idx))


def test_per_document_window_raises_recall_on_packed_documents():
    """Packed synthetic documents (each with its own sink and heavy keys): the per-document window
    keeps more of the document-masked attention than the sequence's last queries, which only see
    the last document (benchmarks/document_index_recall.py measures it at 16K)."""
    from mtraining_jax.sparsity import metrics
    from mtraining_jax.sparsity.synthetic import SyntheticAttention, packed_documents_qk

    S = 1024
    lens = np.asarray([250, 64, 300, 410])
    q, k, seg = packed_documents_qk(lens, SyntheticAttention(num_q_heads=2, num_kv_heads=1, head_dim=32))
    rec = {}
    for window in ("sequence", "per_document"):
        cfg = SparsityConfig(vertical_p=0.9, slash_p=0.9, window=window, window_blocks=16)
        idx = estimate_index(q, k, jnp.arange(S, dtype=jnp.int32), cfg, segment_ids=seg)
        rec[window] = float(metrics.recall(q, k, idx, segment_ids=seg, chunk=512).mean())
    assert rec["per_document"] > rec["sequence"] + 0.05 and rec["per_document"] > 0.9, rec
