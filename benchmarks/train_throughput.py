"""Training throughput on one GPU: dense (``cudnn``) vs sparse (``mtraining``) attention (issue 7).

Measures the real training step of ``mtraining-train --config CONFIG`` — the same config loader and
``key=value`` overrides (:func:`mtraining_jax.train.config.load_config`), the same validation
(:func:`~mtraining_jax.train.loop.check_run_config`), model split, optimizer, state shardings and
jitted ``train_step`` (:func:`~mtraining_jax.train.loop.build_training`) as :func:`mtraining_jax.train.loop.run` — for every (sequence length,
attention backend) pair, and reports the step time, training tokens/s, peak device memory and
compile time, plus the loss of every step and the attention statistics the step returns.

Per configuration the benchmark forces, on top of the config file and the user's ``--set``
overrides (a ``--set`` that gives one of these keys another value is refused, naming both;
``model.dense_backend`` under ``mtraining`` is the user's to choose):

* ``data.seq_len=S``, ``data.batch_size=--batch`` (1), ``optim.grad_accum=1``,
  ``mesh.shape=[1,1]``, ``mesh.data=1`` (one device; the first one when the host has several);
* ``model.attention_backend=BACKEND`` and, per backend:

  - ``cudnn``: ``model.dense_backend=cudnn`` (the config's dense layers too, so every layer is
    cuDNN flash attention); ``check_run_config`` accepts cuDNN on one CP rank, where every layout
    is the identity permutation (its causal mask is by index);
  - ``mtraining``: the loader's layout is the model's (block_striped, stripe = the sparse block
    size: ``loop.run_layout``); the config's dense layers run on cuDNN (``model.dense_backend=cudnn``), the fastest dense attention on one
    GPU, so the two rows differ only in the sparse layers, unless ``--set model.dense_backend=...`` picks another;
  - ``ring`` / ``reference``: ``model.dense_backend=BACKEND``; layout as configured.

On one device every layout is the identity permutation, so all backends see the same tokens in
the same order. Inputs are uniformly random token ids (no corpus is read) cut into
:class:`~mtraining_jax.train.data.Batch` es by the real :class:`~mtraining_jax.train.data.PackedLoader`
(labels shifted before the layout permutation, ``positions`` = the layout's permutation), placed
on the device with the loop's shardings *before* timing, so the clock covers only the step.

Timing: ``train_step.lower(state, batch).compile()`` (reported as ``compile_s``), ``--warmup``
steps, then ``--steps`` timed steps, each waited for with ``jax.block_until_ready`` on the new
state and the metrics; ``step_ms`` is the median, ``tokens_per_s = seq_len * batch / step``.
``peak_gib`` is ``memory_stats()["peak_bytes_in_use"]`` of the device after the last step (None
where the backend has no memory statistics, e.g. CPU). That peak cannot be reset, so the driver
runs every configuration in a fresh subprocess (``--one``, which prints one JSON row as its last
stdout line); a failure in a child (OOM, compile error, timeout, crash) becomes an error row.
The peak covers everything the child allocated through JAX's allocator: state, batches, the step,
and any scratch XLA's autotuner took while compiling (``memory_analysis`` records the compiler's
own argument/output/temp sizes next to it). Children get ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95``
unless set, so that the default 75 % pool does not cause an OOM the device could avoid; the
measured peak does not depend on the pool size.

    # issue 7 (one H200; the 4 configurations, cut off after 5 minutes in all)
    python -m benchmarks.train_throughput --warmup 1 --steps 3 --time-budget 290 \\
        --out /tmp/train_tp
    # re-print the table of saved rows (several files: one table)
    python -m benchmarks.train_throughput --report /tmp/train_tp/train_throughput.jsonl
    # one configuration in this process (what the driver's children run)
    python -m benchmarks.train_throughput --one --seq-len 65536 --backend mtraining

Rows (``OUT/train_throughput.jsonl``, one per configuration; the table also goes to
``OUT/train_throughput.md``): see :data:`ROW_KEYS`; error rows carry ``error`` and the
configuration keys. The driver adds ``date`` and ``command``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import sys
import time
from typing import Optional, Sequence

from benchmarks import _driver
from benchmarks._driver import drive, write_table
from mtraining_jax.attention.backends import BACKENDS
from mtraining_jax.train.config import TrainConfig, load_config  # (no JAX backend start)
from mtraining_jax.train.metrics import device_peak_bytes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_CONFIG = os.path.join(REPO, "configs", "qwen2.5-0.5b-128k.yaml")
BASELINE = "cudnn"
GIB = 2.0**30
#: keys of a successful row (error rows: seq_len, backend, batch, error, + what the child knew)
ROW_KEYS = (
    "commit", "code", "seq_len", "backend", "batch", "mesh", "gpus", "num_processes", "tokens_per_step", "step_ms",
    "step_ms_all", "tokens_per_s",
    "compile_s", "peak_bytes", "peak_gib", "memory_analysis", "losses", "loss_finite", "metrics",
    "work_fraction", "num_params", "model", "layer_backends", "layout", "remat", "dtype",
    "loss_chunk_size", "overrides", "device_kind", "platform", "jax_version", "device", "jax", "profile", "error",
)


# ------------------------------------------------------------------------------ configuration


def backend_overrides(backend: str, ranks: int = 1) -> list[str]:
    """The overrides ``backend`` needs beyond ``model.attention_backend`` (module docstring). On
    several context-parallel ranks (``ranks > 1``) the dense layers run on the dense ring (cuDNN needs
    one rank)."""
    if backend == "cudnn":
        if ranks > 1:
            raise ValueError(f"backend 'cudnn' runs on one device; on {ranks} ranks use 'ring' (the dense ring)")
        return ["model.dense_backend=cudnn"]
    if backend == "mtraining":  # the loader's layout derives from the model's
        return ["model.dense_backend=" + ("cudnn" if ranks == 1 else "ring")]
    return [f"model.dense_backend={backend}"]


def parse_mesh(text: str) -> tuple[int, int]:
    """``"NODExLOCAL"`` -> ``(node, local)``; ``ValueError`` naming the text otherwise."""
    try:
        n, l = (int(t) for t in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"mesh must be NODExLOCAL, e.g. 1x4, got {text!r}") from None
    if n < 1 or l < 1:
        raise ValueError(f"mesh sizes must be >= 1, got {text!r}")
    return n, l


def _key_value(item: str) -> tuple[str, str]:
    key, _, value = item.partition("=")
    return key.strip(), value.replace(" ", "")


def bench_config(config: str, sets: Sequence[str], seq_len: int, backend: str, batch: int = 1,
                 mesh: str = "1x1"):
    """``(TrainConfig, overrides)`` of one benchmark configuration: ``config`` + ``sets`` + the
    benchmark's keys (module docstring). A ``sets`` item that gives one of the benchmark's keys
    another value is a ``ValueError`` naming both (it would be overridden: a silently different
    measurement), except ``model.dense_backend`` under ``mtraining``, where the user's value replaces
    the default dense backend. ``mesh``: ``"NODExLOCAL"`` context-parallel mesh (default one device)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    n, l = parse_mesh(mesh)
    forced = [
        f"data.seq_len={int(seq_len)}", f"data.batch_size={int(batch)}", "optim.grad_accum=1",
        f"mesh.shape=[{n},{l}]", "mesh.data=1", f"model.attention_backend={backend}",
    ]
    user = dict(_key_value(item) for item in sets)
    dense = [] if backend == "mtraining" and "model.dense_backend" in user else backend_overrides(backend, n * l)
    for item in forced + dense:
        key, value = _key_value(item)
        if key in user and user[key] != value:
            raise ValueError(f"--set {key}={user[key]} contradicts the benchmark's {item!r} (its flags set "
                             f"{key}: sequence length, batch, mesh and backend are options of their own)")
    overrides = list(sets) + forced + dense
    return load_config(config, overrides), overrides


def random_batches(cfg: TrainConfig, layout, vocab_size: int, num: int, seed: int = 0):
    """``num`` host :class:`Batch` es ``[1, B, S]`` of uniform random tokens in ``layout`` order,
    cut by the training loader itself."""
    import numpy as np

    from mtraining_jax.train.data import PackedLoader

    S, B = cfg.data.seq_len, cfg.data.batch_size
    stream = np.random.default_rng(seed).integers(0, vocab_size, size=num * B * S + 1, dtype=np.int32)
    loader = PackedLoader(stream, S, B, layout, seed=seed, accum=1, name="random")
    return [next(loader) for _ in range(num)]


# ------------------------------------------------------------------------------ one configuration


def _memory_analysis(compiled) -> Optional[dict]:
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001  (not every backend implements it)
        return None
    if ma is None:
        return None
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes", "host_argument_size_in_bytes",
            "host_output_size_in_bytes", "host_alias_size_in_bytes", "host_temp_size_in_bytes")
    return {k: int(getattr(ma, k)) for k in keys if hasattr(ma, k)}


def run_one(config: str, sets: Sequence[str], seq_len: int, backend: str, *, batch: int = 1,
            warmup: int = 2, steps: int = 5, seed: int = 0, profile: bool = False, mesh: str = "1x1") -> dict:
    """Build, compile and time one configuration in this process; returns its row (raises on
    error — the ``--one`` entry point turns exceptions into error rows). ``profile``: trace one more
    step and add its per-kernel breakdown (:mod:`benchmarks.trace_summary`, kernels attributed to
    JAX ops and source lines) as the row's ``profile``."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    cfg, overrides = bench_config(config, sets, seq_len, backend, batch, mesh)
    from mtraining_jax.train.cli import setup_platform

    setup_platform(cfg.mesh.cpu_devices)  # as the CLI does (CPU configs); no-op on GPU configs

    import jax
    import numpy as np

    from mtraining_jax.train.loop import build_mesh, build_training, check_run_config, to_global
    from mtraining_jax.train.state import build_model_config, num_params
    from mtraining_jax.train.step import batch_shardings
    from mtraining_jax.train.tokenizer import load_tokenizer

    # --- exactly loop.run's construction -----------------------------------------------------
    mesh = build_mesh(cfg.mesh)
    model_cls, model_cfg = build_model_config(cfg.model, cfg.config_dir)
    layout = check_run_config(cfg, model_cfg, mesh, load_tokenizer(cfg.data.tokenizer))
    training = build_training(cfg, mesh, model_cls, model_cfg)
    state_fn, train_step = training.state_fn, training.train_step
    sh_acc = batch_shardings(mesh, True)

    n = warmup + steps
    host = random_batches(cfg, layout, model_cfg.vocab_size, min(n, 4), seed)
    batches = [jax.tree.map(to_global, b, sh_acc) for b in host]
    state = state_fn()
    jax.block_until_ready(state)
    device = mesh.devices.flat[0]

    t0 = time.perf_counter()
    compiled = train_step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0

    times, losses, metrics = [], [], {}
    for i in range(n):
        t0 = time.perf_counter()
        state, out = compiled(state, batches[i % len(batches)])
        jax.block_until_ready((state, out))
        dt = time.perf_counter() - t0
        metrics = {k: float(v) for k, v in jax.device_get(out).items()}
        losses.append(metrics["loss"])
        if i >= warmup:
            times.append(dt)

    step_s = statistics.median(times)
    prof = None
    if profile:
        import tempfile

        from benchmarks.trace_summary import summarize_dir

        with tempfile.TemporaryDirectory() as tdir:
            with jax.profiler.trace(tdir, create_perfetto_trace=True):
                jax.block_until_ready(compiled(state, batches[0]))
            prof = next(iter(summarize_dir(tdir, top=30, hlo_text=compiled.as_text()).values()), None)
    tokens = cfg.data.seq_len * cfg.data.batch_size
    peak = device_peak_bytes(mesh.devices.flat)  # the largest peak over the mesh's devices
    from benchmarks._driver import provenance

    prov = provenance()
    return {
        "commit": prov["commit"],
        "code": prov["code"],
        "seq_len": cfg.data.seq_len,
        "backend": backend,
        "batch": cfg.data.batch_size,
        "mesh": "x".join(str(x) for x in cfg.mesh.shape),
        "gpus": int(mesh.devices.size),
        "num_processes": jax.process_count(),
        "tokens_per_step": tokens,
        "step_ms": 1e3 * step_s,
        "step_ms_all": [1e3 * t for t in times],
        "tokens_per_s": tokens / step_s,
        "compile_s": compile_s,
        "peak_bytes": peak,
        "peak_gib": None if peak is None else peak / GIB,
        "memory_analysis": _memory_analysis(compiled),
        "losses": losses,
        "loss_finite": bool(np.all(np.isfinite(losses))),
        "metrics": metrics,
        "work_fraction": metrics.get("attn/work_fraction"),
        "num_params": num_params(state["params"]),
        "model": model_cfg.name,
        "layer_backends": _runs(model_cfg.layer_backends),
        "layout": layout.name,
        "remat": model_cfg.remat,
        "dtype": model_cfg.dtype,
        "loss_chunk_size": cfg.loss_chunk_size,
        "overrides": list(overrides),
        "device_kind": device.device_kind,
        "platform": device.platform,
        "jax_version": jax.__version__,
        "device": device.device_kind,  # the names every results row uses
        "jax": jax.__version__,
        "profile": prof,
        "error": None,
    }


def _runs(backends) -> str:
    """``("ring", "ring", "mtraining", ...)`` -> ``"2xring+22xmtraining"``."""
    import itertools

    return "+".join(f"{len(list(g))}x{b}" for b, g in itertools.groupby(backends))


def error_row(seq_len: int, backend: str, batch: int, message: str, **extra) -> dict:
    """A row for a configuration that did not finish (message truncated to 2000 characters)."""
    message = message.strip()
    if len(message) > 2000:
        message = message[:1000] + " ... " + message[-995:]
    return {"seq_len": int(seq_len), "backend": backend, "batch": int(batch), "error": message, **extra}


def _one_main(args) -> int:
    try:
        row = run_one(args.config, args.set, args.seq_len, args.backend, batch=args.batch,
                      warmup=args.warmup, steps=args.steps, seed=args.seed, profile=args.profile, mesh=args.mesh)
    except Exception as e:  # noqa: BLE001  (OOM, compile errors, bad config: all become rows)
        extra = {"mesh": args.mesh}
        try:
            import jax

            extra.update(jax_version=jax.__version__, device_kind=jax.devices()[0].device_kind)
        except Exception:  # noqa: BLE001
            pass
        row = error_row(args.seq_len, args.backend, args.batch, f"{type(e).__name__}: {e}", **extra)
    sys.stdout.flush()
    print(json.dumps(row), flush=True)
    return 0


# ------------------------------------------------------------------------------ driver


def child_command(args, seq_len: int, backend: str) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.train_throughput", "--one", "--config", args.config,
           "--seq-len", str(seq_len), "--backend", backend, "--batch", str(args.batch),
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--seed", str(args.seed), "--mesh", args.mesh]
    if args.set:
        cmd += ["--set", *args.set]
    if args.profile:
        cmd.append("--profile")
    return cmd


def run_child(cmd: Sequence[str], seq_len: int, backend: str, batch: int, timeout: float, mesh: str = "1x1") -> dict:
    """Run one ``--one`` child; its last JSON stdout line, or an error row (on ``mesh``)."""
    return _driver.run_child(cmd, REPO, timeout, lambda why: error_row(seq_len, backend, batch, why, mesh=mesh))


def _fmt(x, spec: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-" if x is None else str(x)
    return format(x, spec)


def format_table(rows: Sequence[dict]) -> str:
    """Markdown table: one line per row, speed-up = tokens/s over the ``cudnn`` row of the same
    length and batch."""
    base = {}  # per (length, batch, mesh): cuDNN on one device, the dense ring on several
    for want in ("ring", BASELINE):
        base.update({(r["seq_len"], r.get("batch", 1), r.get("mesh", "1x1")): r["tokens_per_s"] for r in rows
                     if r.get("backend") == want and not r.get("error")})
    head = ("| seq | mesh | backend | step ms | tokens/s | vs dense | peak GiB | compile s | work frac "
            "| loss (first -> last) |")
    lines = [head, "|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["seq_len"], BACKENDS.index(r["backend"]) if r["backend"] in BACKENDS else 99)):
        if r.get("error"):
            msg = " ".join(str(r["error"]).split())[:160].replace("|", "/")
            lines.append(f"| {r['seq_len']} | {r.get('mesh', '1x1')} | {r['backend']} | error: {msg} | | | | | | |")
            continue
        b = base.get((r["seq_len"], r.get("batch", 1), r.get("mesh", "1x1")))
        speed = f"{r['tokens_per_s'] / b:.2f}x" if b else "-"
        losses = r.get("losses") or []
        loss = f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "-"
        lines.append(
            f"| {r['seq_len']} | {r.get('mesh', '1x1')} | {r['backend']} | {_fmt(r['step_ms'], '.1f')} | {_fmt(r['tokens_per_s'], ',.0f')} "
            f"| {speed} | {_fmt(r.get('peak_gib'), '.2f')} | {_fmt(r.get('compile_s'), '.1f')} "
            f"| {_fmt(r.get('work_fraction'), '.3f')} | {loss} |"
        )
    dev = sorted({r.get("device_kind") for r in rows if r.get("device_kind")})
    ver = sorted({r.get("jax_version") for r in rows if r.get("jax_version")})
    if dev or ver:
        lines.append("")
        lines.append(f"device: {', '.join(dev) or '?'}; jax {', '.join(ver) or '?'}")
    return "\n".join(lines)


def load_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _backend_list(text: str) -> list[str]:
    vals = [t.strip() for t in text.split(",") if t.strip()]
    bad = [v for v in vals if v not in BACKENDS]
    if not vals or bad:
        raise argparse.ArgumentTypeError(f"backends must be from {BACKENDS}, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG, help="training YAML (default: %(default)s)")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="config overrides as for mtraining-train (e.g. model.remat=full)")
    p.add_argument("--seq-lens", type=_int_list, default=[65536, 131072], help="comma-separated")
    p.add_argument("--backends", type=_backend_list, default=["cudnn", "mtraining"], help="comma-separated")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--mesh", default="1x1", help="NODExLOCAL context-parallel mesh (default one device); "
                   "on several ranks the dense layers and the 'ring' backend use the dense ring")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration (child)")
    p.add_argument("--time-budget", type=float, help="seconds for the whole run: each child gets at most "
                   "what is left (a configuration cut off becomes a timeout row)")
    p.add_argument("--out", help="folder for train_throughput.jsonl / .md")
    p.add_argument("--report", nargs="+", metavar="JSONL", help="only print the table of saved rows")
    p.add_argument("--profile", action="store_true", help="trace one extra step per configuration: per-kernel "
                   "breakdown (ms, count, JAX op, source line) in each row's 'profile'")
    p.add_argument("--one", action="store_true", help="run one configuration here, print its JSON row")
    p.add_argument("--seq-len", type=int, help="--one: sequence length")
    p.add_argument("--backend", choices=BACKENDS, help="--one: attention backend")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        print(format_table([r for path in args.report for r in load_rows(path)]))
        return 0
    if args.batch < 1 or args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"need --batch >= 1, --steps >= 1, --warmup >= 0; got {args.batch}, {args.steps}, {args.warmup}")
    if args.one:
        if args.seq_len is None or args.backend is None:
            raise SystemExit("--one needs --seq-len and --backend")
        return _one_main(args)
    load_config(args.config, args.set)  # bad config / override: fail before spawning anything
    parse_mesh(args.mesh)
    try:
        _driver.check_code_source()  # the code PYTHONPATH names, not another checkout's
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from None
    command = " ".join(shlex.quote(a) for a in [os.path.relpath(os.path.abspath(__file__), REPO)] +
                       list(sys.argv[1:] if argv is None else argv))
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cases = [(S, b) for S in args.seq_lens for b in args.backends]
    rows = drive(cases, lambda c, t: run_child(child_command(args, *c), *c, args.batch, t, mesh=args.mesh),
                 lambda c, why: error_row(*c, args.batch, why, mesh=args.mesh), timeout=args.timeout,
                 time_budget=args.time_budget,
                 out=args.out, name="train_throughput", command=command, date=date,
                 describe=lambda c, row: f"S={c[0]} {c[1]}: " + (
                     row["error"] or f"{row['step_ms']:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s"))
    write_table(format_table(rows), args.out, "train_throughput", command, date)
    return 0


if __name__ == "__main__":
    sys.exit(main())
