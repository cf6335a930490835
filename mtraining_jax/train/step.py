"""The jitted training and evaluation steps.

One training step = ``A = optim.grad_accum`` micro-batches ``[A, B, S]`` under ``lax.scan``: each
gives its summed token loss (:func:`~mtraining_jax.train.loss.sharded_cross_entropy`) and
gradient; ``grad = sum_grad / num_tokens`` (the token mean over all micro-batches) goes through
clipping + AdamW. Tokens / labels / mask are sharded ``P(None, data?, (node, local))`` in layout
order; the gradient accumulator takes the parameters' shardings (:mod:`.sharding`; under FSDP each
micro-batch's gradient is reduce-scattered into it). Compute runs in the model's ``dtype`` from
float32 master weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtraining_jax.mesh import CP_AXES
from mtraining_jax.model.qwen2 import is_index_branch_path
from mtraining_jax.train.data import Batch
from mtraining_jax.train.loss import sharded_cross_entropy
from mtraining_jax.train.state import ModelParts, bind, replicated


_global_norm = optax.tree.norm if hasattr(optax, "tree") and hasattr(optax.tree, "norm") else optax.global_norm


def index_branch_grad_norm(grads):
    """``float32`` global norm of the MSA index-branch leaves of a gradient (parameter dict).

    The LM loss never reaches the index branch (detached input, discrete selection; tested), so in
    the train step's gradient these leaves are exactly the gradient of the KL term as it enters the
    objective, ``kl_coef * sum_layers KL`` (token-weighted over micro-batches like the LM loss):
    logged as ``msa/kl_grad_norm``. ``0`` for a tree without index-branch leaves."""
    leaves = [x for path, x in jax.tree_util.tree_leaves_with_path(grads) if is_index_branch_path(path)]
    return _global_norm(leaves) if leaves else jnp.zeros((), jnp.float32)


def batch_shardings(mesh: Mesh | None, accum: bool, segments: bool = False, rope_positions: bool = False):
    """``Batch`` of shardings: sequence over ``(node, local)``, batch over ``data``
    (``segments`` / ``rope_positions``: the batches carry those fields, ``data.pack: documents``)."""
    if mesh is None:
        return None
    b = "data" if "data" in mesh.shape else None
    spec = P(None, b, CP_AXES) if accum else P(b, CP_AXES)
    s = NamedSharding(mesh, spec)
    return Batch(s, s, s, NamedSharding(mesh, P()), s if segments else None, s if rope_positions else None)


def forward_with_metrics(model, *args, **kwargs):
    """``(hidden, metrics)``: ``metrics`` holds, keyed ``attn/<name>``, the mean over the sparse
    (``mtraining``) layers of the attention statistics the model returns (work fraction, worker-
    and step-level imbalance of the executed ring, MTraining §3.3); empty when no layer is sparse.
    The train step averages them over micro-batches and logs them with the training metrics."""
    out, stats = model(*args, return_stats=True, **kwargs)
    return out, {f"attn/{k}": jnp.mean(v.astype(jnp.float32)) for k, v in stats.items()}


def make_loss_fn(parts: ModelParts, mesh: Mesh | None, chunk_size: int, msa=None):
    """``loss_fn(params, micro_batch, step=None, log_metrics=True) -> (loss_sum, (num_correct, num_tokens, extras))``.

    Models with ``msa`` layers (``msa``: a :class:`~mtraining_jax.train.config.MSATrainConfig`,
    default no warm-up, ``kl_coef`` 1): ``step < msa.warmup_steps`` runs the warm-up (``step=None``:
    sparse), and ``kl_coef * num_tokens * sum_layers KL`` enters the gradient as
    ``x - stop_gradient(x)``: the returned loss (the logged one) stays the LM loss while the index
    branch gets the KL gradient (token-weighted over micro-batches like the LM loss).
    ``log_metrics`` (bool, may be traced): compute the monitoring-only ``attn/msa_recall`` (NaN
    otherwise)."""

    def loss_fn(params, batch: Batch, step=None, log_metrics=True):
        model = bind(parts, params)
        docs = {} if batch.segment_ids is None else {"segment_ids": batch.segment_ids}
        if batch.rope_positions is not None:
            docs["rope_positions"] = batch.rope_positions
        has_msa = getattr(model.config, "has_msa", False)
        if has_msa:
            warm = msa is not None and step is not None and msa.warmup_steps > 0
            docs["msa_warmup"] = (step < msa.warmup_steps) if warm else False
            docs["msa_metrics"] = log_metrics
        hidden, extras = forward_with_metrics(model, batch.tokens, batch.positions, mesh=mesh, **docs)
        w = model.lm_head_weight()
        loss_sum, correct, count = sharded_cross_entropy(hidden, w, batch.labels, batch.mask, mesh, chunk_size)
        if has_msa:
            kl = extras["attn/msa_kl"] * model.config.layer_backends.count("msa") * count
            kl = (1.0 if msa is None else msa.kl_coef) * kl
            loss_sum = loss_sum + (kl - jax.lax.stop_gradient(kl))
            extras["msa/warmup"] = jnp.asarray(docs["msa_warmup"], jnp.float32)
        return loss_sum, (correct, count, extras)

    return loss_fn


def make_train_step(parts: ModelParts, optimizer, schedule, mesh: Mesh | None, chunk_size: int, state_sharding=None,
                    offload_update=None, msa=None):
    """Jitted ``train_step(state, batch[A, B, S], log_metrics=True) -> (state, metrics)``; ``state`` is
    donated. ``log_metrics`` (a traced bool: no recompilation): compute the monitoring-only
    metrics that cost device time (``attn/msa_recall``, NaN otherwise); the loop passes its logging steps.
    ``state_sharding``: the state's pytree of shardings (its ``params`` also shard the gradients).
    ``offload_update``: ``None`` (``optimizer.update`` on the device) or
    ``f(grad_sum, denom, grad_norm, opt_state, params, ok) -> (params, opt_state)`` for an optimizer
    state in host memory, the gradients being ``grad_sum / denom`` (divided where they are used, so
    that no second gradient-sized buffer is made) and ``grad_norm`` their global norm
    (:func:`mtraining_jax.train.offload.streamed_update`). ``msa``: the MSA schedule (:func:`make_loss_fn`)."""
    loss_fn = make_loss_fn(parts, mesh, chunk_size, msa)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    param_sh = state_sharding["params"] if isinstance(state_sharding, dict) else None
    like_params = (lambda t: t) if param_sh is None else (  # noqa: E731
        lambda t: jax.lax.with_sharding_constraint(t, param_sh))

    def train_step(state, batch: Batch, log_metrics=True):
        params = state["params"]

        def micro(carry, mb):
            g_acc, l_acc, c_acc, n_acc = carry
            (loss, (corr, cnt, extras)), g = grad_fn(params, mb._replace(positions=batch.positions), state["step"],
                                                     log_metrics)
            g_acc = like_params(jax.tree.map(lambda a, b: a + b.astype(a.dtype), g_acc, like_params(g)))
            return (g_acc, l_acc + loss, c_acc + corr, n_acc + cnt), extras

        zeros = like_params(jax.tree.map(jnp.zeros_like, params))
        z = jnp.zeros((), jnp.float32)
        (g, loss, corr, cnt), extras = jax.lax.scan(
            micro, (zeros, z, z, z), batch._replace(positions=None)
        )
        denom = jnp.maximum(cnt, 1.0)
        grads = jax.tree.map(lambda x: x / denom.astype(x.dtype), g)
        # A non-finite loss or gradient leaves parameters and optimizer state untouched (a skipped
        # update; the loop counts them and stops after optim.max_bad_steps in a row): the state in
        # memory never holds NaNs.
        grad_norm = _global_norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if offload_update is not None:
            new_params, opt_state = offload_update(g, denom, grad_norm, state["opt_state"], params, ok)
        else:
            updates, opt_state = optimizer.update(grads, state["opt_state"], params)
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
            new_params = keep(optax.apply_updates(params, updates), params)
            opt_state = keep(opt_state, state["opt_state"])
        new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state, "rng": state["rng"]}
        if "msa/warmup" in extras:
            extras = {**extras, "msa/kl_grad_norm": index_branch_grad_norm(grads)}
        metrics = {
            "loss": loss / denom,
            "accuracy": corr / denom,
            "grad_norm": grad_norm,
            "lr": schedule(state["step"]),
            "tokens": cnt,
            **{k: jnp.mean(v) for k, v in extras.items()},
        }
        return new_state, metrics

    out_sh = None if mesh is None else (state_sharding, replicated(mesh))
    return jax.jit(train_step, donate_argnums=(0,), out_shardings=out_sh)


def make_eval_step(parts: ModelParts, mesh: Mesh | None, chunk_size: int):
    """Jitted ``eval_step(params, batch[B, S]) -> (loss_sum, num_correct, num_tokens)``."""
    loss_fn = make_loss_fn(parts, mesh, chunk_size)

    def eval_step(params, batch: Batch):
        loss, (corr, cnt, _) = loss_fn(params, batch)
        return loss, corr, cnt

    return jax.jit(eval_step)
