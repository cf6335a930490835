"""Host offload of the optimizer state (``optim.offload: opt_state``) through JAX memory kinds.

The AdamW moments live in the device's ``pinned_host`` memory between steps (shardings with
``memory_kind="pinned_host"``; FSDP shards them as before), so the forward and backward run
without them. :func:`streamed_update` updates the non-layer parameters in one piece, then runs a
``lax.fori_loop`` over the stacked layers that copies one layer's moments host -> device, applies
the same optax AdamW and writes them back: the device holds ONE layer's moments at a time, and the
numbers equal those without offload (the gradients' division and global-norm clip are applied per
slice as ``optax.clip_by_global_norm`` does). ``optim.offload_stream: false``: :func:`whole_update`
moves the whole state to the device for the update instead.

Needs ``pinned_host`` memory (GPUs, the CPU backend; :func:`check_host_memory` raises
``ValueError`` otherwise). The master weights stay on the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from mtraining_jax.train.sharding import STACKED_KEY

HOST = "pinned_host"
# what each optim.offload mode puts in host memory (keys of the training state)
OFFLOADED_KEYS = {"none": (), "opt_state": ("opt_state",)}


def offloaded_keys(mode: str) -> tuple[str, ...]:
    """State keys ``mode`` keeps in host memory; ``ValueError`` naming an unknown mode."""
    if mode not in OFFLOADED_KEYS:
        raise ValueError(f"optim.offload must be one of {tuple(OFFLOADED_KEYS)}, got {mode!r}")
    return OFFLOADED_KEYS[mode]


def check_host_memory(mode: str, mesh) -> None:
    """``ValueError`` when ``mode`` offloads something but the mesh's devices have no
    ``pinned_host`` memory (naming the platform and the memories it has)."""
    if not offloaded_keys(mode):
        return
    if mesh is None:
        raise ValueError(f"optim.offload={mode!r} needs a device mesh")
    dev = mesh.devices.flat[0]
    try:
        kinds = sorted({m.kind for m in dev.addressable_memories()})
    except Exception:  # noqa: BLE001  (backends without memory spaces)
        kinds = []
    if HOST not in kinds:
        raise ValueError(f"optim.offload={mode!r} needs '{HOST}' memory, but the {dev.platform} device {dev} "
                         f"has only {kinds or 'its default memory'}; set optim.offload=none")


def with_offload(shardings: dict, keys: tuple[str, ...]) -> dict:
    """The state's shardings with the subtrees ``keys`` moved to ``pinned_host`` memory."""
    if not keys or shardings is None:
        return shardings
    return {k: (jax.tree.map(lambda s: s.with_memory_kind(HOST), v) if k in keys else v)
            for k, v in shardings.items()}


def _to(tree, space):
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def _param_tree_test(keys):
    keys = set(keys)
    return lambda x: isinstance(x, dict) and set(x) == keys


def whole_update(optimizer, grad_sum, denom, grad_norm, opt_state, params, ok):
    """``optim.offload_stream: false``: the whole optimizer state host -> device after the
    gradients are complete (an ``optimization_barrier`` orders the copy after them), one
    ``optimizer.update``, the new state device -> host. Simpler for XLA than
    :func:`streamed_update`, but the update holds all moments on the device at once.
    Same contract as :func:`streamed_update` (``optimizer``: the full chain)."""
    grads = jax.tree.map(lambda x: x / denom.astype(x.dtype), grad_sum)
    grads, opt_state = jax.lax.optimization_barrier((grads, opt_state))
    dev = _to(opt_state, jax.memory.Space.Device)
    updates, new = optimizer.update(grads, dev, params)
    keep = lambda a, b: jax.tree.map(lambda x, y: jnp.where(ok, x, y), a, b)  # noqa: E731
    return keep(optax.apply_updates(params, updates), params), _to(keep(new, dev), jax.memory.Space.Host)


def _clipper(clip_norm: float, denom, g_norm):
    """``f(t)``: one slice of the gradient sum divided by ``denom`` and clipped by the global norm
    ``g_norm`` of all of ``grad_sum / denom`` with the operations of
    ``optax.clip_by_global_norm(clip_norm)`` (``select(norm < clip, t, t / norm * clip)``)."""
    scaled = lambda t: t / denom.astype(t.dtype)  # noqa: E731
    if clip_norm <= 0:
        return scaled
    trigger = jnp.squeeze(g_norm < clip_norm)
    return lambda t: jax.lax.select(trigger, scaled(t), (scaled(t) / g_norm.astype(t.dtype)) * clip_norm)


def streamed_update(adamw, clip_norm: float, grad_sum, denom, grad_norm, opt_state, params, ok):
    """One AdamW step with the optimizer state in host memory (module docstring), inside ``jit``.

    Args:
      adamw: the optax AdamW transformation (without clipping).
      clip_norm: global-norm clip (0: none) of the gradients ``grad_sum / denom``, as
        ``optax.clip_by_global_norm`` does it.
      grad_sum, params: parameter dicts on the device; ``denom``: float32 scalar; ``grad_norm``:
        the global norm of ``grad_sum / denom``.
      opt_state: the state of ``chain(clip, adamw)`` (or of ``adamw`` when ``clip_norm == 0``) in
        host memory.
      ok: bool scalar; where false, parameters and state are returned unchanged (a skipped step).

    Returns:
      ``(new_params on the device, new opt_state in host memory)``.
    """
    clip = _clipper(clip_norm, denom, grad_norm)
    if clip_norm > 0:
        clip_state, inner = opt_state
    else:
        clip_state, inner = None, opt_state
    is_pt = _param_tree_test(params)
    is_rest, is_layer = _param_tree_test(set(params) - {STACKED_KEY}), _param_tree_test({STACKED_KEY})
    leaves, treedef = jax.tree.flatten(inner, is_leaf=is_pt)
    pt_idx = [i for i, x in enumerate(leaves) if is_pt(x)]  # mu, nu (parameter-shaped dicts)

    def build(pts, others):
        it_p, it_o = iter(pts), iter(others)
        return jax.tree.unflatten(treedef, [next(it_p) if i in pt_idx else next(it_o) for i in range(len(leaves))])

    others = _to([x for i, x in enumerate(leaves) if i not in pt_idx], jax.memory.Space.Device)  # counts
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
    rest = lambda d: {k: v for k, v in d.items() if k != STACKED_KEY}  # noqa: E731

    # the parameters outside the layer stack, in one piece
    pts_rest = _to([rest(leaves[i]) for i in pt_idx], jax.memory.Space.Device)
    st_rest = build(pts_rest, others)
    upd, new_st_rest = adamw.update(jax.tree.map(clip, rest(grad_sum)), st_rest, rest(params))
    new_params = keep(optax.apply_updates(rest(params), upd), rest(params))
    new_st_rest = keep(new_st_rest, st_rest)
    new_leaves = jax.tree.flatten(new_st_rest, is_leaf=is_rest)[0]
    new_pts = [new_leaves[i] for i in pt_idx]
    new_others = [x for i, x in enumerate(new_leaves) if i not in pt_idx]

    if STACKED_KEY in params:  # the decoder layers, one at a time, updated in place
        at = lambda tree, i: jax.tree.map(  # noqa: E731
            lambda t: jax.lax.dynamic_index_in_dim(t, i, keepdims=False), tree)
        put = lambda tree, new, i: jax.tree.map(  # noqa: E731
            lambda t, u: jax.lax.dynamic_update_index_in_dim(t, u, i, 0), tree, new)
        g_layers = grad_sum[STACKED_KEY]

        def layer(i, carry):
            p_layers, pts_layers = carry
            g_i, p_i = jax.tree.map(clip, at(g_layers, i)), at(p_layers, i)
            pts_i = _to(at(pts_layers, i), jax.memory.Space.Device)  # one layer's moments host -> device
            st_i = build([{STACKED_KEY: t} for t in pts_i], others)
            u_i, new_st_i = adamw.update({STACKED_KEY: g_i}, st_i, {STACKED_KEY: p_i})
            new_p_i = keep(optax.apply_updates({STACKED_KEY: p_i}, u_i), {STACKED_KEY: p_i})[STACKED_KEY]
            nl = jax.tree.flatten(keep(new_st_i, st_i), is_leaf=is_layer)[0]
            new_pts_i = _to([nl[j][STACKED_KEY] for j in pt_idx], jax.memory.Space.Host)  # device -> host
            return put(p_layers, new_p_i, i), put(pts_layers, new_pts_i, i)

        # a loop carry (not scan outputs): the donated parameters and moments are rewritten in
        # place, one layer slice per iteration, with no second full-size buffer
        n = jax.tree.leaves(g_layers)[0].shape[0]
        new_layers, new_pts_layers = jax.lax.fori_loop(
            0, n, layer, (params[STACKED_KEY], [leaves[j][STACKED_KEY] for j in pt_idx]))
        new_params[STACKED_KEY] = new_layers
        new_pts = [{**p, STACKED_KEY: lp} for p, lp in zip(new_pts, new_pts_layers)]
    new_pts = [{**_to(rest(p), jax.memory.Space.Host), **({STACKED_KEY: p[STACKED_KEY]} if STACKED_KEY in p else {})}
               for p in new_pts]
    new_inner = build(new_pts, _to(new_others, jax.memory.Space.Host))
    new_params = {k: new_params[k] for k in params}  # the parameters' key order
    return new_params, (new_inner if clip_state is None else (clip_state, new_inner))
