"""Memory plan of a training run before it starts (``mtraining-train --config ... --plan``).

:func:`memory_plan` builds the run's mesh, model, state shardings and training step exactly as
:func:`~mtraining_jax.train.loop.setup` does (:func:`~mtraining_jax.train.loop.build_training`),
lowers and compiles the step for abstract inputs (nothing is allocated, no data is read) and reads
the compiled step's ``memory_analysis`` — the partitioned, per-device program. Per device:

* ``params``, ``opt_state``: the shard bytes of the state (FSDP: ~1/devices of the replicated);
  with ``optim.offload: opt_state`` the optimizer state is in host memory (``host``), not counted
  in the device peak (one layer's moments pass through the device in the update: in ``temp``);
* ``grads``: the gradient accumulator, the parameters' shard bytes (part of XLA's temporaries);
* ``batch``: the step's token / label / mask / position shards;
* ``activations``: XLA's temporary bytes minus the gradient accumulator — layer activations kept
  for the backward pass (per ``model.remat``; ``selective``: ``save_attn`` layers keep their
  attention residuals, ``full`` layers only their input), attention residuals and the sparse
  index, and workspace; ``/ layer`` divides it by the number of layers;
* ``peak``: ``argument + output - alias + temp`` of the compiled step in device memory (the
  donated state aliases its output). Backends that report host memory separately
  (``host_argument_size_in_bytes``, GPUs) leave the offloaded state out of these; where the
  analysis lumps all memories together (CPU) the offloaded bytes are subtracted
  (:func:`device_peak`).

The device's memory is ``memory_stats()["bytes_limit"]`` of the mesh's first device where the
backend reports it (GPUs), else the ``--device-memory`` value; when neither is known the plan
says so and does not judge. :class:`DoesNotFit` names what to change.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp

from mtraining_jax.train.config import TrainConfig
from mtraining_jax.train.data import Batch
from mtraining_jax.train.sharding import shard_bytes

GIB = 1024 ** 3
MIB = 1024 ** 2
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2 ** 10, "m": 1e6, "mb": 1e6, "mib": 2 ** 20,
          "g": 1e9, "gb": 1e9, "gib": 2 ** 30, "t": 1e12, "tb": 1e12, "tib": 2 ** 40}


def fmt_bytes(b: float) -> str:
    """``"1.50 GiB"`` from 1 GiB up, else ``"12.3 MiB"``."""
    return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / MIB:.1f} MiB"


class DoesNotFit(ValueError):
    """The plan's peak exceeds the device memory (the message names what to change)."""


def parse_bytes(text: str) -> int:
    """``"80GiB"`` / ``"141G"`` / ``"1.5e10"`` -> bytes; ``ValueError`` naming the value."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"--device-memory must be a size like 80GiB, 141G or 8e10 bytes, got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of one training step (module docstring)."""

    params: int
    grads: int
    opt_state: int
    batch: int
    activations: int
    num_layers: int
    argument: int
    output: int
    alias: int
    temp: int
    device_memory: int | None  # None: unknown
    fsdp: bool
    num_devices: int
    remat: str
    host: int = 0  # per-device bytes of the state kept in pinned_host memory (optim.offload)
    offload: str = "none"
    saved_layers: int | None = None  # remat selective: layers keeping their attention residuals

    @property
    def peak(self) -> int:
        """Device bytes of the compiled step (``argument``, ``output``, ``alias`` are device-only)."""
        return self.argument + self.output - self.alias + self.temp

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.peak <= self.device_memory

    def table(self) -> str:
        g = lambda b: f"{fmt_bytes(b):>11}"  # noqa: E731
        rows = [
            ("parameters", self.params),
            ("gradients", self.grads),
            ("optimizer state" + (" (in host memory)" if self.host else ""), self.opt_state),
            ("batch", self.batch),
            ("activations+attention residuals+index+workspace", self.activations),
        ]
        remat = self.remat + (f" ({self.saved_layers}/{self.num_layers} layers save_attn)"
                              if self.saved_layers is not None else "")
        head = (f"memory plan per device ({self.num_devices} device(s), "
                f"{'FSDP-sharded' if self.fsdp else 'replicated'} state, remat={remat}, "
                f"optim.offload={self.offload}):")
        lines = [head] + [f"  {k:<50}{g(v)}" for k, v in rows]
        lines.append(f"  {'  of which per layer':<50}{g(self.activations / max(self.num_layers, 1))}")
        lines.append(f"  {'peak (compiled step: argument+output-alias+temp)':<50}{g(self.peak)}")
        if self.device_memory is None:
            lines.append("  device memory unknown (this backend reports none): pass --device-memory, e.g. 80GiB")
        else:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"  {'device memory':<50}{g(self.device_memory)}  -> {verdict} "
                         f"({100 * self.peak / self.device_memory:.0f}% used)")
        return "\n".join(lines)

    def advice(self, cfg: TrainConfig) -> list[str]:
        """Config changes that shrink the largest parts of the peak, biggest first."""
        out = []
        state = self.params + self.grads + self.opt_state
        if not self.fsdp and self.num_devices > 1:
            out.append(f"mesh.fsdp=true (state {fmt_bytes(state)} -> ~{fmt_bytes(state / self.num_devices)} per device)")
        remat = []
        if self.remat in ("none", "save_attn"):
            remat.append(f"model.remat=selective (now {self.remat}; keeps the attention residuals of "
                         "model.remat_save_fraction of the layers, default half)")
        if self.remat != "full":
            remat.append(f"model.remat=full (now {self.remat}; keeps only each layer's input)")
        offload = ([f"optim.offload=opt_state (the optimizer state, {fmt_bytes(self.opt_state)}, to host memory)"]
                   if self.offload == "none" else [])
        out += remat + offload if self.activations >= self.opt_state else offload + remat  # the larger part first
        if cfg.data.batch_size > 1:
            out.append(f"a smaller data.batch_size (now {cfg.data.batch_size}) with a larger optim.grad_accum")
        out.append(f"a shorter data.seq_len (now {cfg.data.seq_len}) or more devices (mesh.shape / mesh.data)")
        return out


def _abstract_batch(cfg: TrainConfig, shardings) -> Batch:
    A, B, S = cfg.optim.grad_accum, cfg.data.batch_size, cfg.data.seq_len
    sds = lambda shape, dt, sh: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    sh = shardings if shardings is not None else Batch(None, None, None, None)
    return Batch(sds((A, B, S), jnp.int32, sh.tokens), sds((A, B, S), jnp.int32, sh.labels),
                 sds((A, B, S), jnp.float32, sh.mask), sds((S,), jnp.int32, sh.positions))


def device_memory_limit(device) -> int | None:
    """``bytes_limit`` of ``device``'s memory statistics, ``None`` where the backend has none."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001  (CPU and some plugins raise or return None)
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def memory_plan(cfg: TrainConfig, device_memory: int | None = None) -> MemoryPlan:
    """Compile ``cfg``'s training step for abstract inputs and return its :class:`MemoryPlan`.
    ``device_memory`` (bytes) is used where the device does not report its own."""
    from mtraining_jax.train.loop import build_mesh, build_training, check_run_config
    from mtraining_jax.train.state import build_model_config
    from mtraining_jax.train.step import batch_shardings
    from mtraining_jax.train.tokenizer import load_tokenizer

    mesh = build_mesh(cfg.mesh)
    model_cls, model_cfg = build_model_config(cfg.model, cfg.config_dir)
    check_run_config(cfg, model_cfg, mesh, load_tokenizer(cfg.data.tokenizer))
    t = build_training(cfg, mesh, model_cls, model_cfg)
    batch = _abstract_batch(cfg, batch_shardings(mesh, True))
    ma = t.train_step.lower(t.abstract, batch).compile().memory_analysis()
    if ma is None:
        raise ValueError("this JAX backend gives no memory analysis of the compiled step; --plan cannot run here")
    params = shard_bytes(t.abstract["params"])
    host = host_state_bytes(t.abstract)
    argument, output, alias, temp = device_sizes(ma, host)
    limit = device_memory_limit(mesh.devices.flat[0])
    return MemoryPlan(
        params=params, grads=params, opt_state=shard_bytes(t.abstract["opt_state"]), batch=shard_bytes(batch),
        activations=max(temp - params, 0), num_layers=model_cfg.num_layers,
        argument=argument, output=output, alias=alias, temp=temp,
        device_memory=limit if limit is not None else device_memory, fsdp=t.fsdp,
        num_devices=int(mesh.size), remat=model_cfg.remat, host=host, offload=cfg.optim.offload,
        saved_layers=len(model_cfg.remat_saved_layers) if model_cfg.remat == "selective" else None)


def host_state_bytes(abstract_state) -> int:
    """Per-device bytes of the state's leaves whose sharding is in ``pinned_host`` memory."""
    return shard_bytes([x for x in jax.tree.leaves(abstract_state)
                        if getattr(getattr(x, "sharding", None), "memory_kind", None) == "pinned_host"])


def device_sizes(ma, host: int) -> tuple[int, int, int, int]:
    """``(argument, output, alias, temp)`` device bytes of a compiled step's memory analysis
    ``ma`` (an object or a dict of its fields) whose state holds ``host`` bytes in host memory.
    Where the backend counts host buffers separately (``host_argument_size_in_bytes > 0``) the
    device fields are taken as they are; where it lumps them in (CPU: one memory) the offloaded
    state — an argument, an output and donated, so also aliased — is taken out of all three."""
    get = (lambda k: int(ma.get(k, 0) or 0)) if isinstance(ma, dict) else (lambda k: int(getattr(ma, k, 0) or 0))
    a, o, al, t = (get(k) for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                                    "temp_size_in_bytes"))
    if host and not get("host_argument_size_in_bytes"):
        a, o, al = a - host, o - host, max(al - host, 0)
    return a, o, al, t


def predicted_peak(ma, host: int = 0) -> int:
    """The plan's device peak ``argument + output - alias + temp`` from a memory analysis."""
    a, o, al, t = device_sizes(ma, host)
    return a + o - al + t


def check_fits(plan: MemoryPlan, cfg: TrainConfig) -> None:
    """:class:`DoesNotFit` naming the peak, the device memory and what to change."""
    if plan.fits is False:
        raise DoesNotFit(
            f"the training step needs {fmt_bytes(plan.peak)} per device but the device has "
            f"{fmt_bytes(plan.device_memory)}; change: " + "; or ".join(plan.advice(cfg)))
