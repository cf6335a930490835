"""Memory plan of a training run before it starts (``mtraining-train --config ... --plan``).

:func:`memory_plan` builds the run's mesh, model, state shardings and training step as
:func:`~mtraining_jax.train.loop.setup` does, compiles the step for abstract inputs (nothing
allocated, no data read) and reads the compiled per-device ``memory_analysis``:

* ``params``, ``opt_state``: the state's shard bytes (``optim.offload: opt_state``: in ``host``,
  not in the device peak);
* ``grads``: the gradient accumulator (part of XLA's temporaries); ``batch``: the step's inputs;
* ``activations``: XLA's temporaries minus the gradient accumulator (kept activations per
  ``model.remat``, attention residuals, workspace); ``/ layer`` per layer;
* ``peak``: ``argument + output - alias + temp`` in device memory, offloaded host bytes left out
  (:func:`device_sizes`, :func:`predicted_peak`).

The plan is compiled for THIS host's devices. It is judged against ``--device h100|h200``
(:data:`DEVICE_MEMORY`, scaled by ``XLA_PYTHON_CLIENT_MEM_FRACTION``), else ``--device-memory
SIZE``, else the device's reported ``bytes_limit``; none known (CPU): not judged. A plan compiled
on a CPU for a GPU target is the CPU program's. :class:`DoesNotFit` names what to change.
"""

from __future__ import annotations

import dataclasses
import os
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


@dataclasses.dataclass(frozen=True)
class TargetDevice:
    """A GPU ``--plan`` can be judged against: ``full_bytes`` is ``memory_stats()["bytes_limit"]``
    under ``XLA_PYTHON_CLIENT_MEM_FRACTION=1.0`` (all but the CUDA context); JAX gives a process
    ``fraction x full_bytes`` (default fraction 0.75)."""

    name: str
    kind: str  # jax device_kind
    full_bytes: int

    def bytes(self, fraction: float) -> int:
        return int(self.full_bytes * fraction)

    def describe(self) -> str:
        return f"{self.kind}, {self.full_bytes / GIB:.2f} GiB x XLA_PYTHON_CLIENT_MEM_FRACTION"


#: ``bytes_limit`` each GPU reports at XLA_PYTHON_CLIENT_MEM_FRACTION=1.0 (JAX 0.11.2, CUDA 13)
DEVICE_MEMORY = {
    "h100": TargetDevice("h100", "NVIDIA H100 80GB HBM3", 85_018_542_080),  # 79.18 GiB
    "h200": TargetDevice("h200", "NVIDIA H200", 150_109_945_856),  # 139.80 GiB
}
DEFAULT_MEM_FRACTION = 0.75  # JAX's XLA_PYTHON_CLIENT_MEM_FRACTION default


def mem_fraction() -> float:
    """``XLA_PYTHON_CLIENT_MEM_FRACTION`` of this environment (JAX's default 0.75 when unset)."""
    text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "").strip()
    try:
        f = float(text) if text else DEFAULT_MEM_FRACTION
    except ValueError:
        raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION must be a number in (0, 1], got {text!r}") from None
    if not 0 < f <= 1:
        raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION must be a number in (0, 1], got {text!r}")
    return f


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
    platform: str = "cpu"  # of the devices the step was compiled for (this host's)
    device_kind: str = ""
    target: str | None = None  # what device_memory is: "h100 (...)", "--device-memory", None: this host's device
    target_gpu: bool = False  # the target is a GPU (named, or this host's GPU)
    fraction: float | None = None  # XLA_PYTHON_CLIENT_MEM_FRACTION behind device_memory (named GPU)

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
        lines = [head, f"  compiled for this host's devices: {self.num_devices} x {self.device_kind or self.platform} "
                       f"({self.platform})"]
        lines += [f"  {k:<50}{g(v)}" for k, v in rows]
        lines.append(f"  {'  of which per layer':<50}{g(self.activations / max(self.num_layers, 1))}")
        lines.append(f"  {'peak (compiled step: argument+output-alias+temp)':<50}{g(self.peak)}")
        if self.device_memory is None:
            lines.append(f"  device memory unknown: this plan is for this host's {self.platform} devices, which report "
                         f"no memory limit; pass --device h100|h200 or --device-memory SIZE to judge it against a "
                         f"GPU's memory")
        else:
            verdict = "fits" if self.fits else "does NOT fit"
            what = f" [{self.target}]" if self.target else " [reported by this host's device]"
            lines.append(f"  {'device memory':<50}{g(self.device_memory)}  -> {verdict} "
                         f"({100 * self.peak / self.device_memory:.0f}% used){what}")
        if self.cpu_for_gpu:
            lines.append(f"  note: compiled on this host's {self.platform}, not on the GPU: the attention kernels (XLA "
                         f"twins instead of Pallas / cuDNN) and XLA's buffer assignment differ there, so this peak is "
                         f"not the GPU's; run --plan on the GPU for its plan")
        return "\n".join(lines)

    @property
    def cpu_for_gpu(self) -> bool:
        """Compiled on a CPU but judged against a GPU's memory."""
        return self.platform == "cpu" and self.target_gpu

    def advice(self, cfg: TrainConfig) -> list[str]:
        """Config changes that shrink the largest parts of the peak, biggest first."""
        out = []
        state = self.params + self.grads + self.opt_state
        if not self.fsdp and self.num_devices > 1:
            out.append(f"mesh.fsdp=true (state {fmt_bytes(state)} -> "
                       f"~{fmt_bytes(state / self.num_devices)} per device)")
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
        frac = self.fraction if self.fraction is not None else (mem_fraction() if self.platform == "gpu" else None)
        if self.target_gpu and frac is not None and frac < 0.95 and self.device_memory:
            more = self.device_memory / frac * 0.95
            if self.peak <= more:
                out.append(f"XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (now {frac:g}: {fmt_bytes(more)} instead of "
                           f"{fmt_bytes(self.device_memory)})")
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


def memory_plan(cfg: TrainConfig, device_memory: int | None = None, device: str | None = None) -> MemoryPlan:
    """Compile ``cfg``'s training step for abstract inputs and return its :class:`MemoryPlan`,
    judged against ``device`` (a :data:`DEVICE_MEMORY` name), else ``device_memory`` (bytes), else
    what this host's device reports (module docstring)."""
    if device is not None and device not in DEVICE_MEMORY:
        raise ValueError(f"--device must be one of {sorted(DEVICE_MEMORY)}, got {device!r}")
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
    dev0 = mesh.devices.flat[0]
    limit = device_memory_limit(dev0)
    target, target_gpu, fraction = None, dev0.platform == "gpu", None
    if device is not None:
        fraction = mem_fraction()
        d = DEVICE_MEMORY[device]
        limit, target_gpu = d.bytes(fraction), True
        target = f"{device}: XLA_PYTHON_CLIENT_MEM_FRACTION={fraction:g} x {fmt_bytes(d.full_bytes)}"
    elif device_memory is not None:
        limit, target, target_gpu = device_memory, "--device-memory", False
    return MemoryPlan(
        params=params, grads=params, opt_state=shard_bytes(t.abstract["opt_state"]), batch=shard_bytes(batch),
        activations=max(temp - params, 0), num_layers=model_cfg.num_layers,
        argument=argument, output=output, alias=alias, temp=temp,
        device_memory=limit, fsdp=t.fsdp,
        num_devices=int(mesh.size), remat=model_cfg.remat, host=host, offload=cfg.optim.offload,
        saved_layers=len(model_cfg.remat_saved_layers) if model_cfg.remat == "selective" else None,
        platform=dev0.platform, device_kind=getattr(dev0, "device_kind", ""), target=target, target_gpu=target_gpu,
        fraction=fraction)


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
        what = f" ({plan.target})" if plan.target and plan.target != "--device-memory" else ""
        where = (f" (the {plan.platform} program's peak: run --plan on the GPU to confirm)" if plan.cpu_for_gpu else "")
        raise DoesNotFit(
            f"the training step needs {fmt_bytes(plan.peak)} per device{where} but the device has "
            f"{fmt_bytes(plan.device_memory)}{what}; change: " + "; or ".join(plan.advice(cfg)))
