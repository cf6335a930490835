"""Where a training step's compile time and peak memory go (issue 34: compile <= 20 s, peak <= 1.05x
the all-cuDNN trainer, Qwen2.5-0.5B shape at 128K).

Each variant runs in its own process (no compiled program may be reused across variants). A process builds the training step as
``mtraining-train --plan`` does (:func:`mtraining_jax.train.plan.memory_plan`: abstract inputs,
nothing allocated), times ``lower`` and ``compile`` separately, counts the Mosaic GPU kernels in the
lowered program and reads XLA's memory analysis (``peak = argument + output - alias + temp``, the
number ``--plan`` prints and the trainer's peak matches to 0.02 %).

Variants: ``cudnn`` (every layer cuDNN); ``mt`` (MTraining as configured: ``stream="auto"``, the Mosaic
forward's two streams' kernels compiled, the dQ's split one); ``mt-index`` (``model.ring.kernel_stream=index``:
both passes choose per call, two kernels each; the default before 2026-12-03); ``mt-shared``
(``model.ring.kernel_stream=shared``: every forward / dQ call on the shared stream, one kernel each);
``-dqswitch`` (the dQ's shared stream walked with one loop, ``walk="switch"``: no config option, the
kernel call is patched; with ``index`` or ``shared``); ``mt-split`` (``kernel_stream=split``: the forward
too on the split stream, one kernel); ``mt-int2`` /
``mt-bf16out`` (the sparse layers' output residual as int2 codes / none, patched: what the int4 codes cost at
the peak); ``mt-flatrepeats`` (a repeated layer pattern run as one scan per run and repeat, patched);
``-noprecompile`` (``MTRAINING_MOSAIC_PRECOMPILE=0``: every Mosaic kernel compiled inside the step's compile,
as before :mod:`pallas_kernels.mosaic_precompile`; with ``mt`` or ``mt-split``).
Variants measured and removed are in ``results/training/train_throughput.md`` with the commit that had them.
``--set KEY=VALUE ...`` overrides the config for every variant (e.g. ``'model.dense_layers=[]'``). ``--dump DIR``
also writes XLA's dumps there and lists the largest values of the step's temporary allocation (what the peak
holds; offsets show which cannot be live together).

    python -m benchmarks.compile_memory --variants mt,mt-shared,cudnn --json results.jsonl
    python -m benchmarks.compile_memory --variants mt --dump /tmp/dump --top 40
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VARIANTS = ("cudnn", "mt", "mt-index", "mt-shared", "mt-index-dqswitch", "mt-shared-dqswitch", "mt-int2", "mt-bf16out",
            "mt-flatrepeats", "mt-split", "mt-noprecompile", "mt-split-noprecompile")
GIB = 2 ** 30


def _patch_dq_walk() -> None:
    """The Mosaic dQ kernel walks its shared stream with one loop (``walk="switch"``)."""
    from pallas_kernels import mosaic_dq, mosaic_stream

    run_stream = mosaic_stream.run_stream

    def patched(launch, index, k, v, q_pos, k_pos, bs, segs, kv_step, slots, walk, stream, uniform=False,
                kernel="fwd"):
        if "mosaic_dq" in launch.__qualname__:
            walk = "switch"
        return run_stream(launch, index, k, v, q_pos, k_pos, bs, segs, kv_step, slots, walk, stream, uniform, kernel)

    mosaic_dq.run_stream = patched


def _patch_flat_repeats() -> None:
    """A repeated layer pattern (``layer_plan.layer_blocks``' ``repeats >= 2``, e.g. a dense layer every fourth)
    runs as one scan per run and repeat instead of one scan over the repeats whose body scans each run: the
    nested scan's inner residual stacks are copied into / out of the outer stack (``--dump`` of
    ``[0,4,...,20]``). Every repeat's layer bodies are traced again."""
    from mtraining_jax.model import qwen2

    scan_blocks = qwen2._scan_blocks

    def flat(x, stacked, blocks, layer_fns):
        runs = []
        for start, reps, pattern in blocks:
            period = sum(length for _, length, _ in pattern)
            runs += [(start + r * period, 1, pattern) for r in range(reps)]
        return scan_blocks(x, stacked, tuple(runs), layer_fns)

    qwen2._scan_blocks = flat


def _patch_output_residual(variant: str) -> None:
    """The sparse layers' saved output residual (``pallas_kernels.api.split_output``): ``mt-int2`` keeps int2
    codes (a quarter byte per element, the error in half-ulp steps) instead of the library's int4; ``mt-bf16out``
    keeps none (delta from the bf16 output, as cuDNN forms it). What the int4 codes cost at the step's peak;
    their gradient accuracy is ``benchmarks/bf16_gradients.py``'s (``--residuals int2,int4,bf16``)."""
    import jax.numpy as jnp

    from mtraining_jax.ring import attention
    from pallas_kernels import api

    if variant.endswith("-int2"):
        api.LO_DTYPE = jnp.int2
    elif variant.endswith("-bf16out"):
        attention.split_output = api.split_output = lambda out, dtype: (out.astype(dtype), None)


def measure(variant: str, config: str, seq_len: int, extra_sets=()) -> dict:
    """One variant in this process: setup / lower / compile seconds, Mosaic kernel launches, memory."""
    import time

    import jax

    from benchmarks.train_throughput import bench_config
    from mtraining_jax.train.loop import build_mesh, build_training, check_run_config
    from mtraining_jax.train.plan import _abstract_batch
    from mtraining_jax.train.state import build_model_config
    from mtraining_jax.train.step import batch_shardings
    from mtraining_jax.train.tokenizer import load_tokenizer

    if "dqswitch" in variant:
        _patch_dq_walk()
    if variant == "mt-flatrepeats":
        _patch_flat_repeats()
    _patch_output_residual(variant)
    stream = next((s for s in ("shared", "index", "split") if s in variant), None)
    sets = ([f"model.ring.kernel_stream={stream}"] if stream else []) + list(extra_sets)
    cfg, overrides = bench_config(config, sets, seq_len, "cudnn" if variant == "cudnn" else "mtraining", 1)
    t0 = time.perf_counter()
    mesh = build_mesh(cfg.mesh)
    model_cls, model_cfg = build_model_config(cfg.model, cfg.config_dir)
    check_run_config(cfg, model_cfg, mesh, load_tokenizer(cfg.data.tokenizer))
    t = build_training(cfg, mesh, model_cls, model_cfg)
    batch = _abstract_batch(cfg, batch_shardings(mesh, True))
    t1 = time.perf_counter()
    lowered = t.train_step.lower(t.abstract, batch)
    t2 = time.perf_counter()
    ma = lowered.compile().memory_analysis()
    t3 = time.perf_counter()
    text = lowered.as_text()
    from pallas_kernels import mosaic_precompile

    early = mosaic_precompile.stats()
    peak = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    return {"variant": variant, "seq_len": seq_len, "config": config, "overrides": overrides,
            "setup_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2,
            "mosaic_calls": mosaic_calls(text), "mlir_chars": len(text),
            "precompile": early["active"] or bool(early["errors"]), "precompiled": early["compiled"],
            "precompile_errors": early["errors"],
            "temp_gib": ma.temp_size_in_bytes / GIB, "peak_gib": peak / GIB,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__}


def mosaic_calls(text: str) -> int:
    """Mosaic GPU kernel launches (``custom_call @mosaic_gpu...``) in a lowered program's text. Rows before
    2026-11-29 have ``mosaic_kernels`` instead: every mention of ``mosaic_gpu`` in the text (145 / 95 for
    the 128K step), not a count of kernels (6 / 4)."""
    return len(re.findall(r"custom_call @mosaic_gpu\w*\(", text))


def temp_values(path: str, top: int) -> list:
    """The ``top`` largest values of the preallocated temporary allocation in an XLA
    ``*buffer-assignment.txt``: ``(size_bytes, offset, name, shape)``, one per (offset, size)."""
    lines = open(path).read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("allocation") and "preallocated-temp" in line)
    seen = {}
    for line in lines[start + 1:]:
        if line.startswith("allocation"):
            break
        m = re.match(r" value: <\d+ (\S+) @0> \(size=(\d+),offset=(\d+)\): (.*)", line)
        if m:
            seen.setdefault((int(m.group(2)), int(m.group(3))), (m.group(1), m.group(4)[:100]))
    return sorted(((s, o, n, sh) for (s, o), (n, sh) in seen.items()), reverse=True)[:top]


def main(argv=None) -> int:
    from benchmarks._driver import append_rows, provenance

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="mt,mt-shared,cudnn", help=f"comma-separated, of {VARIANTS}")
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "qwen2.5-0.5b-128k.yaml"))
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="config overrides for every variant (e.g. 'model.dense_layers=[]')")
    p.add_argument("--json", help="append one row per variant to this JSONL file")
    p.add_argument("--dump", help="XLA dump folder (one sub-folder per variant); lists the temp allocation's values")
    p.add_argument("--top", type=int, default=30, help="values listed with --dump")
    p.add_argument("--timeout", type=float, default=240, help="seconds per variant")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print("ROW " + json.dumps(measure(a.child, a.config, a.seq_len, a.set)), flush=True)
        return 0
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"compile_memory: unknown variants {bad}; expected some of {VARIANTS}")
    prov, rows = provenance(argv), []
    for v in variants:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if "noprecompile" in v:
            env["MTRAINING_MOSAIC_PRECOMPILE"] = "0"
        if a.dump:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={os.path.join(a.dump, v)}").strip()
        cmd = [sys.executable, "-m", "benchmarks.compile_memory", "--child", v, "--config", a.config,
               "--seq-len", str(a.seq_len)] + (["--set", *a.set] if a.set else [])
        try:
            out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout)
            row = next((json.loads(x[4:]) for x in out.stdout.splitlines() if x.startswith("ROW ")), None)
            row = row or {"variant": v, "error": (out.stderr or out.stdout)[-600:]}
        except subprocess.TimeoutExpired:
            row = {"variant": v, "error": f"timed out after {a.timeout:g} s"}
        rows.append(row)
        print(json.dumps({k: x for k, x in row.items() if k != "overrides"}), flush=True)
        if a.dump and "error" not in row:
            folder = os.path.join(a.dump, v)
            files = sorted((f for f in os.listdir(folder) if f.endswith("buffer-assignment.txt") and "train_step" in f),
                           key=lambda f: -os.path.getsize(os.path.join(folder, f)))
            for size, off, name, shape in temp_values(os.path.join(folder, files[0]), a.top) if files else []:
                print(f"  {size / 2**20:9.1f} MiB @ {off / GIB:7.3f} GiB  {name:40s} {shape}")
    append_rows(a.json, rows, prov)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
