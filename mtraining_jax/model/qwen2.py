"""Qwen2 / Qwen2.5 decoder-only language model in Flax NNX with pluggable attention.

Architecture (transformers ``Qwen2ForCausalLM``; Qwen2 technical report arXiv:2407.10671 §2.1):
``h0 = E[tokens]``; each layer ``h = h + Attn(RMSNorm(h)); h = h + MLP(RMSNorm(h))``;
``hidden = RMSNorm(h_L)``; ``logits = hidden @ W`` with ``W = E^T`` when embeddings are tied.

* RMSNorm: ``w * (x / sqrt(mean(x^2) + eps))`` with the statistics in float32.
* Attention: bias on Q/K/V, none on O; ``Hq`` query heads in ``Hkv`` contiguous GQA groups; RoPE
  (optionally YaRN, :mod:`.rope`) at the tokens' global positions; causal by position; scale
  ``head_dim ** -0.5``; the backend per layer (:mod:`mtraining_jax.attention.dispatch`).
* MSA index branch (layers using ``msa``; MSA paper Eqs. msa-index-proj / msa-detach):
  ``q_idx = sg(x) W_q^idx [B, S, Hkv, d_idx]``, ``k_idx = sg(x) W_k^idx [B, S, d_idx]``, no bias, no
  RoPE; trained only by the KL.
* MLP (SwiGLU): ``down(silu(gate(x)) * up(x))``, no biases.

Shapes: ``tokens int32 [B, S]`` in layout order, ``positions int32 [S]`` (global position of each
laid-out token, shared by the batch), hidden ``[B, S, hidden]`` in ``cfg.dtype``.

Layers: ONE stacked module (every parameter has a leading ``[num_layers]`` axis, ``nnx.vmap``), so
checkpoints and the HF mapping do not depend on how the layers run. ``cfg.scan_layers=True`` runs
each run of consecutive layers with one (backend, remat policy) as one ``jax.lax.scan``, and a pattern
of such runs repeated back to back (a dense layer every fourth layer) as one scan over its repeats
(:mod:`.layer_plan`): the runs read their layers from the stack by index and add their weight gradients to
one shared buffer (:func:`_read_layer`); ``False`` unrolls a Python loop. Each layer is wrapped in
``jax.checkpoint`` by ``cfg.remat``:

* ``none``: keep every activation;
* ``full``: save only the layer input;
* ``save_attn``: recompute the projections, norms and MLP but not the attention core, whose custom
  VJP residuals (q, k, v, out, lse, the sparse index) are kept (:func:`_layer_fn`);
* ``selective``: ``save_attn`` for ``cfg.remat_saved_layers``, ``full`` for the others (per layer,
  not per sequence position as in BurstEngine §3.2: a checkpoint policy saves whole values, and the
  attention core is one custom VJP over the local sequence).

Every policy keeps the exact gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mtraining_jax.attention.dispatch import attention
from mtraining_jax.model.config import ModelConfig
from mtraining_jax.model.layer_plan import backend_segments, layer_blocks  # noqa: F401 (re-exported)
from mtraining_jax.model.rope import apply_rope, rope_cos_sin, rope_parameters


def _dtype(name: str):
    return jnp.dtype(name)


class RMSNorm(nnx.Module):
    """``weight * x / sqrt(mean(x^2, -1) + eps)``; statistics in (at least) float32, output in x's dtype."""

    def __init__(self, dim: int, eps: float, *, param_dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        var = jnp.mean(xf * xf, axis=-1, keepdims=True)
        y = (xf * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return self.weight[...].astype(x.dtype) * y


def _linear(cfg: ModelConfig, n_in: int, n_out: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        n_in,
        n_out,
        use_bias=bias,
        dtype=_dtype(cfg.dtype),
        param_dtype=_dtype(cfg.param_dtype),
        kernel_init=nnx.initializers.normal(cfg.initializer_range),
        bias_init=nnx.initializers.zeros_init(),
        rngs=rngs,
    )


MSA_INDEX_MODULES: tuple[str, ...] = ("index_q", "index_k")  # the index branch's projections (attributes below)


def is_index_branch_path(path) -> bool:
    """Whether a parameter's key path (``jax.tree_util`` keys of the parameter dict) lies in an
    MSA index-branch projection (:data:`MSA_INDEX_MODULES`)."""
    return any(getattr(k, "key", getattr(k, "name", None)) in MSA_INDEX_MODULES for k in path)


class Qwen2Attention(nnx.Module):
    """GQA self-attention: biased Q/K/V, unbiased O, RoPE at global positions."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = _linear(cfg, h, cfg.num_heads * d, True, rngs)
        self.k_proj = _linear(cfg, h, cfg.num_kv_heads * d, True, rngs)
        self.v_proj = _linear(cfg, h, cfg.num_kv_heads * d, True, rngs)
        self.o_proj = _linear(cfg, cfg.num_heads * d, h, False, rngs)
        if cfg.has_msa:
            self.index_dim = cfg.msa_index_dim
            self.index_q = _linear(cfg, h, cfg.num_kv_heads * self.index_dim, False, rngs)
            self.index_k = _linear(cfg, h, self.index_dim, False, rngs)

    def index_qk(self, x):
        """MSA index branch of ``x [B, S, hidden]`` (input detached): ``(q_idx [B, S, Hkv, d_idx],
        k_idx [B, S, d_idx])``."""
        B, S, _ = x.shape
        xs = jax.lax.stop_gradient(x)
        return (self.index_q(xs).reshape(B, S, self.num_kv_heads, self.index_dim), self.index_k(xs))

    def qkv(self, x, cos, sin):
        """``x [B, S, hidden]`` -> RoPE'd ``q [B, S, Hq, D]``, ``k, v [B, S, Hkv, D]``."""
        B, S, _ = x.shape
        q = self.q_proj(x).reshape(B, S, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, S, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, S, self.num_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, o):
        """``o [B, S, Hq, D]`` -> ``[B, S, hidden]``."""
        B, S = o.shape[:2]
        return self.o_proj(o.reshape(B, S, self.num_heads * self.head_dim))

    def inputs(self, x, cos, sin, backend: str):
        """``(q, k, v)``, plus the index branch's ``(q_idx, k_idx)`` for an ``msa`` layer."""
        qkv = self.qkv(x, cos, sin)
        return (*qkv, self.index_qk(x)) if backend == "msa" else qkv

    def __call__(self, x, cos, sin, positions, *, backend: str, **attn_kwargs):
        """``attn_kwargs``: the keywords of :func:`~mtraining_jax.attention.dispatch.attention` for
        ``backend`` (``ModelConfig.attention_spec``, ``mesh``, ``segment_ids``, the ``msa`` flags)."""
        o, stats = attend_inputs(self.inputs(x, cos, sin, backend), positions, backend=backend, **attn_kwargs)
        return self.output(o), stats


def attend(q, k, v, positions, **kwargs):
    """The attention core of a layer (no parameters): ``(o [B, S, Hq, D], stats)``."""
    return attention(q, k, v, positions, return_stats=True, **kwargs)


def attend_inputs(inputs, positions, **kwargs):
    """:func:`attend` on a layer's ``inputs``: ``(q, k, v)`` or, for ``msa``, ``(q, k, v, (q_idx, k_idx))``."""
    q, k, v, *index = inputs
    if index:
        kwargs["msa_index"] = index[0]
    return attend(q, k, v, positions, **kwargs)


class Qwen2MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(cfg, h, f, False, rngs)
        self.up_proj = _linear(cfg, h, f, False, rngs)
        self.down_proj = _linear(cfg, f, h, False, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nnx.Module):
    """Pre-norm block: ``h += Attn(norm(h)); h += MLP(norm(h))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        p = _dtype(cfg.param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=p)
        self.self_attn = Qwen2Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=p)
        self.mlp = Qwen2MLP(cfg, rngs=rngs)

    def attention_inputs(self, x, cos, sin, backend: str = "reference"):
        """``(q, k, v)`` of ``norm(x)`` (the part of the layer before the attention core), plus the
        index branch's ``(q_idx, k_idx)`` for an ``msa`` layer."""
        return self.self_attn.inputs(self.input_layernorm(x), cos, sin, backend)

    def finish(self, x, o):
        """``x + O(o)`` then the MLP block (the part of the layer after the attention core)."""
        x = x + self.self_attn.output(o)
        return x + self.mlp(self.post_attention_layernorm(x))

    def __call__(self, x, cos, sin, positions, *, backend: str, **attn_kwargs):
        """``attn_kwargs``: as :meth:`Qwen2Attention.__call__`."""
        o, stats = attend_inputs(self.attention_inputs(x, cos, sin, backend), positions, backend=backend,
                                 **attn_kwargs)
        return self.finish(x, o), stats


def gather_layer_params(layer_state, mesh):
    """One layer's parameters constrained to be replicated over ``mesh`` (no-op without a mesh or
    when they already are). Applied inside the layer scan body (and inside its ``jax.checkpoint``
    pieces), so parameters stored sharded (FSDP, :mod:`mtraining_jax.train.sharding`) are
    all-gathered one layer at a time in the forward, gathered again for the recomputation in the
    backward, and the layer's gradient is reduce-scattered back by the constraint's transpose."""
    if mesh is None:
        return layer_state
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.lax.with_sharding_constraint(layer_state, NamedSharding(mesh, PartitionSpec()))


def _index_layer(stacked, i):
    return jax.tree.map(lambda t: jax.lax.dynamic_index_in_dim(t, i, keepdims=False), stacked)


@jax.custom_jvp
def _read_layer(frozen, acc, i):
    """Layer ``i`` of ``frozen`` (leaves ``[n_layers, ...]``) whose tangent is layer ``i`` of ``acc``'s (the
    same stacked weights, carried from run to run; ``frozen``'s tangent is ignored). So the backward adds
    each layer's gradient into the one buffer every run of layers shares (a dynamic-update-slice) instead
    of each run accumulating its own ``[n_layers, ...]`` gradient from zeros, summed at the end (1.8 GiB
    of the Qwen2.5-0.5B step's peak at 128K with two dense layers). The primal never reads ``acc``, so
    a checkpointed piece that calls this does not save ``acc`` for its recomputation."""
    del acc
    return _index_layer(frozen, i)


@_read_layer.defjvp
def _read_layer_jvp(primals, tangents):
    frozen, _, i = primals  # neither output reads acc's value
    return _index_layer(frozen, i), _index_layer(tangents[1], i)


@jax.custom_vjp
def _carry_through(acc):
    """``acc`` unchanged, opaque to ``lax.scan``: a carry JAX sees forwarded unchanged becomes a loop
    constant, whose gradient each loop would then accumulate from zeros (:func:`_read_layer`)."""
    return acc


_carry_through.defvjp(lambda acc: (acc, None), lambda _, g: (g,))


def _layer_params(layer_state):
    """One layer's state from ``layer_state``: the state itself, or ``(frozen, acc, i)`` (layer ``i`` of the
    stacked states, :func:`_read_layer`, indexed where this is called: inside a checkpointed piece the
    backward indexes again rather than keeping the layer; under ``remat: none`` the indexed layer is kept)."""
    if isinstance(layer_state, tuple):
        return _read_layer(*layer_state)
    return layer_state


def _layer_fn(graphdef, cos, sin, positions, attn_kwargs: dict, policy: str, prevent_cse: bool):
    """``f(h, layer_state) -> (h, stats)`` for one decoder layer under the remat ``policy``;
    ``layer_state``: the layer's state or ``(frozen, acc, i)`` (:func:`_layer_params`).

    ``save_attn`` checkpoints the parameter pieces before and after the attention core separately and
    leaves the core outside ``jax.checkpoint``: its custom VJP residuals (q, k, v, out, lse, the sparse
    index) are saved, so the backward never reruns the attention forward (nor the index estimate).
    """

    mesh = attn_kwargs.get("mesh")

    def layer(st):
        return nnx.merge(graphdef, gather_layer_params(_layer_params(st), mesh))

    def whole(h, layer_state):
        return layer(layer_state)(h, cos, sin, positions, **attn_kwargs)

    if policy == "none":
        return whole
    if policy == "full":
        return jax.checkpoint(whole, prevent_cse=prevent_cse)
    if policy != "save_attn":
        raise ValueError(f"unknown remat policy {policy!r}")
    backend = attn_kwargs["backend"]
    before = jax.checkpoint(lambda h, st: layer(st).attention_inputs(h, cos, sin, backend), prevent_cse=prevent_cse)
    after = jax.checkpoint(lambda h, o, st: layer(st).finish(h, o), prevent_cse=prevent_cse)

    def split(h, layer_state):
        o, stats = attend_inputs(before(h, layer_state), positions, **attn_kwargs)
        return after(h, o, layer_state), stats

    return split


@functools.lru_cache(maxsize=32)
def _rope_tables(head_dim: int, theta: float, scaling_items: tuple | None):
    return rope_parameters(head_dim, theta, None if scaling_items is None else dict(scaling_items))


def _scan_layers(fn, carry, frozen, first, length: int):
    """``lax.scan`` of ``fn`` over layers ``first .. first + length - 1`` (``first`` may be traced) of a run
    that is not the whole stack. ``carry = (x, acc)``: the hidden state and the stacked weights whose
    gradient every run shares; ``frozen``: the same weights, read (their gradient goes to ``acc``). The
    body reads each layer inside its checkpointed pieces (``fn`` gets ``(frozen, acc, i)``,
    :func:`_layer_params`), so the backward indexes again instead of keeping a copy of the run's weights
    (a slice ``stacked[a:b]`` is a copy the backward keeps: 1.3 GiB of float32 weights with two dense
    layers in the Qwen2.5-0.5B step)."""

    def body(c, i):
        h, acc = c
        h, st = fn(h, (frozen, acc, i))
        return (h, _carry_through(acc)), st

    return jax.lax.scan(body, carry, first + jnp.arange(length, dtype=jnp.int32))


def _scan_pattern(carry, frozen, base, pattern, layer_fns):
    """Run one repeat's runs (``pattern``, :func:`~mtraining_jax.model.layer_plan.layer_blocks`: offsets
    from layer ``base``, which may be traced; ``carry``, ``frozen``: :func:`_scan_layers`); stats
    ``{name: [period]}`` in layer order."""
    stats = []
    for offset, length, key in pattern:
        carry, st = _scan_layers(layer_fns(key), carry, frozen, base + offset, length)
        if st:
            stats.append(st)
    return carry, {k: jnp.concatenate([s[k] for s in stats]) for k in (stats[0] if stats else {})}


def _scan_blocks(x, stacked, blocks, layer_fns):
    """``(x, [stats {name: [n]}])`` of the layers in ``blocks`` (``layer_fns(key)``: the layer body of a
    key); a block of ``repeats >= 2`` is one scan over its repeats whose body runs the pattern, so each
    key's body is traced once. One run over the whole stack scans ``stacked`` as its ``xs``; otherwise
    every run reads its layers by index and adds their gradients to one shared buffer
    (:func:`_scan_layers`, :func:`_read_layer`)."""
    n = jax.tree.leaves(stacked)[0].shape[0]
    if len(blocks) == 1 and blocks[0][1] == 1 and len(blocks[0][2]) == 1 and blocks[0][2][0][:2] == (0, n):
        x, st = jax.lax.scan(layer_fns(blocks[0][2][0][2]), x, stacked)
        return x, [st] if st else []
    frozen, carry, out = stacked, (x, stacked), []
    for start, reps, pattern in blocks:
        period = sum(length for _, length, _ in pattern)
        if reps == 1:
            carry, st = _scan_pattern(carry, frozen, start, pattern, layer_fns)
        else:
            carry, st = jax.lax.scan(
                lambda c, r: _scan_pattern(c, frozen, start + r * period, pattern, layer_fns), carry,
                jnp.arange(reps, dtype=jnp.int32))
            st = {k: v.reshape(-1) for k, v in st.items()}
        if st:
            out.append(st)
    return carry[0], out


class Qwen2ForCausalLM(nnx.Module):
    """Qwen2 causal LM (see module docstring). Parameters in ``cfg.param_dtype``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        p = _dtype(cfg.param_dtype)
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=_dtype(cfg.dtype),
            param_dtype=p,
            embedding_init=nnx.initializers.normal(cfg.initializer_range),
            rngs=rngs,
        )

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(r):
            return Qwen2DecoderLayer(cfg, rngs=r)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=p)
        if not cfg.tie_word_embeddings:
            init = nnx.initializers.normal(cfg.initializer_range)
            self.lm_head = nnx.Param(init(rngs.params(), (cfg.hidden_size, cfg.vocab_size), p))

    # ------------------------------------------------------------------ helpers
    def lm_head_weight(self):
        """``[hidden, vocab]`` output projection (the embedding transposed when tied)."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.embedding[...].T
        return self.lm_head[...]

    def rope(self, positions):
        """``cos, sin [..., S, head_dim]`` in the compute dtype for ``positions [..., S]``."""
        cfg = self.config
        items = None if cfg.rope_scaling is None else tuple(sorted(cfg.rope_scaling.items()))
        inv_freq, factor = _rope_tables(cfg.head_dim, cfg.rope_theta, items)
        return rope_cos_sin(positions, inv_freq, factor, _dtype(cfg.dtype))

    def _check_inputs(self, tokens, positions, segment_ids, rope_positions):
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, S], got shape {tokens.shape}")
        if positions.shape != (tokens.shape[1],):
            raise ValueError(f"positions must be [S] = [{tokens.shape[1]}], got shape {positions.shape}")
        for name, a in (("segment_ids", segment_ids), ("rope_positions", rope_positions)):
            if a is not None and tuple(a.shape) != tuple(tokens.shape):
                raise ValueError(f"{name} must be [B, S] = {list(tokens.shape)} like tokens, got shape {a.shape}")

    # ------------------------------------------------------------------ forward
    def __call__(self, tokens, positions, mesh=None, *, segment_ids=None, rope_positions=None,
                 return_stats: bool = False, msa_warmup=False, msa_metrics=True):
        """Final-normed hidden states ``[B, S, hidden]`` in ``cfg.dtype``.

        ``segment_ids int [B, S]`` (packed documents): no token attends across a document;
        ``rope_positions int [B, S]``: RoPE positions (default ``positions``). The causal mask is always
        by the global ``positions``. ``return_stats=True`` also returns ``{name: float32 [num layers of
        that backend]}``: the ``mtraining`` layers' work fraction and worker / step imbalance, the ``msa``
        layers' ``msa_kl`` (differentiable in the index branch) and ``msa_recall`` (empty when no layer
        is sparse). ``msa_warmup``, ``msa_metrics`` (bools, may be traced): as the ``msa`` backend's
        (:func:`mtraining_jax.attention.dispatch.attention`).
        """
        cfg = self.config
        tokens, positions = jnp.asarray(tokens), jnp.asarray(positions)
        segment_ids = None if segment_ids is None else jnp.asarray(segment_ids)
        rope_positions = None if rope_positions is None else jnp.asarray(rope_positions)
        self._check_inputs(tokens, positions, segment_ids, rope_positions)
        x = self.embed_tokens(tokens).astype(_dtype(cfg.dtype))
        cos, sin = self.rope(positions if rope_positions is None else rope_positions)
        graphdef, stacked = nnx.split(self.layers)

        def run_layer(backend, policy):
            attn_kwargs = dict(cfg.attention_spec(backend), mesh=mesh, segment_ids=segment_ids)
            if backend == "msa":
                attn_kwargs.update(msa_warmup=msa_warmup, msa_metrics=msa_metrics)
            return _layer_fn(graphdef, cos, sin, positions, attn_kwargs, policy, prevent_cse=not cfg.scan_layers)

        keys = tuple(zip(cfg.layer_backends, cfg.layer_remats))
        if cfg.scan_layers:  # one scan per block; a repeated multi-run pattern as one scan over its repeats
            x, per_segment = _scan_blocks(x, stacked, layer_blocks(keys), lambda k: run_layer(*k))
        else:
            per_segment = []
            for start, stop, key in backend_segments(keys):
                f = run_layer(*key)
                outs = []
                for i in range(start, stop):
                    x, s_i = f(x, jax.tree.map(lambda t: t[i], stacked))
                    outs.append(s_i)
                st = jax.tree.map(lambda *a: jnp.stack(a), *outs)
                if st:
                    per_segment.append(st)
        h = self.norm(x)
        if not return_stats:
            return h
        stats = {k: jnp.concatenate([s[k] for s in per_segment]) for k in (per_segment[0] if per_segment else {})}
        return h, stats

    def logits(self, tokens, positions, mesh=None):
        """``float32 [B, S, vocab]`` logits (materialised: small models and tests only)."""
        h = self(tokens, positions, mesh=mesh)
        return jnp.einsum(
            "bsh,hv->bsv", h.astype(jnp.float32), self.lm_head_weight().astype(jnp.float32), precision="highest"
        )


def abstract_model(cfg: ModelConfig) -> Qwen2ForCausalLM:
    """A model whose parameters are ``jax.ShapeDtypeStruct`` (no allocation, no random init)."""
    return nnx.eval_shape(lambda: Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))
