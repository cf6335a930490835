"""Which Qwen2.5 shape trains on one GPU at 64K / 128K tokens with MTraining attention, with and
without optimizer-state offload and selective checkpointing, and how close ``--plan`` is (issue 20).

For every (model size, sequence length, variant) the real training step of
``mtraining-train --config configs/qwen2.5-0.5b-128k.yaml`` is built, compiled and timed by
:func:`benchmarks.train_throughput.run_one` in a fresh subprocess (its peak-memory counter cannot
be reset; an OOM kills nothing but that child), with these overrides on top of the config:

* ``model.path=model/qwen2.5-<size>.yaml`` (0.5b, 1.5b, 3b, 7b: the Hugging Face shapes),
  ``model.max_position_embeddings=131072``, ``model.dense_layers=[0,1]`` (cuDNN, as in the config;
  every other layer MTraining sparse attention), bfloat16 compute, float32 master weights and
  AdamW moments, batch 1, ``grad_accum=1``, one device;
* the variant ``REMAT[+offload|+offload_whole]``: ``model.remat=REMAT`` (``none``, ``save_attn``,
  ``selective`` — half the layers save_attn: the two dense layers, then the first sparse ones,
  ``full``) and ``optim.offload=opt_state`` with
  ``+offload`` (streamed per layer) or ``+offload_whole`` (``optim.offload_stream=false``).

Each row records whether it fits (a child that fails with an out-of-memory error is a
"does not fit" row), tokens/s (median of ``--steps`` timed steps after ``--warmup``), the measured
peak (``memory_stats()["peak_bytes_in_use"]``) and ``--plan``'s prediction for the same compiled
step (:func:`mtraining_jax.train.plan.predicted_peak` of its memory analysis: the plan compiles
exactly this program) with the relative error ``plan / measured - 1``. The table goes to
``OUT/memory_plan.md``, the rows to ``OUT/memory_plan.jsonl``.

    # one H200; each call within 8 minutes (--time-budget cuts the rest off as 'skipped' rows)
    python -m benchmarks.memory_plan --sizes 7b --seq-lens 65536 \\
        --variants full+offload,selective+offload,save_attn+offload --time-budget 450 --out $OUT
    python -m benchmarks.memory_plan --report OUT/memory_plan.jsonl   # re-print the table
    python -m benchmarks.memory_plan --one --size 3b --seq-len 65536 --variant selective  # one row here
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from typing import Optional, Sequence

from benchmarks import _driver
from benchmarks._driver import drive, write_table
from benchmarks.train_throughput import DEFAULT_CONFIG, GIB, REPO, error_row, run_one

SIZES = ("0.5b", "1.5b", "3b", "7b", "tiny")  # tiny: configs/model/tiny.yaml, a CPU smoke test
REMATS = ("none", "save_attn", "selective", "full")
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM")


OFFLOADS = {"": "none", "offload": "opt_state", "offload_whole": "opt_state (whole)"}


def parse_variant(text: str) -> tuple[str, str]:
    """``"selective+offload"`` -> ``("selective", "offload")``; ``""`` without offload;
    ``ValueError`` naming a bad one."""
    remat, plus, rest = text.partition("+")
    if remat not in REMATS or (plus and rest not in ("offload", "offload_whole")):
        raise ValueError(f"variant must be REMAT, REMAT+offload or REMAT+offload_whole with REMAT in {REMATS}, "
                         f"got {text!r}")
    return remat, rest


def case_overrides(size: str, variant: str) -> list[str]:
    """The ``key=value`` overrides of one case (module docstring)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    remat, offload = parse_variant(variant)
    extra = ["model.remat_save_fraction=0.5"] if remat == "selective" else []
    model = ["model.path=model/tiny.yaml", "model.vocab_size=512", "model.dense_layers=[0]", "model.dtype=float32",
             "loss_chunk_size=512"] if size == "tiny" else [f"model.path=model/qwen2.5-{size}.yaml", "model.dense_layers=[0,1]"]
    return model + extra + ["model.max_position_embeddings=131072", "model.rope_scaling=null", f"model.remat={remat}",
            f"optim.offload={'opt_state' if offload else 'none'}", f"optim.offload_stream={str(offload != 'offload_whole').lower()}",
            "eval.every=0", "eval.passkey_samples=0"]


def _host_bytes(config: str, sets: Sequence[str], seq_len: int) -> int:
    """Per-device bytes of the state in host memory (the offloaded optimizer state)."""
    from benchmarks.train_throughput import bench_config
    from mtraining_jax.train.loop import build_mesh, build_training
    from mtraining_jax.train.plan import host_state_bytes
    from mtraining_jax.train.state import build_model_config

    cfg, _ = bench_config(config, sets, seq_len, "mtraining")
    model_cls, model_cfg = build_model_config(cfg.model, cfg.config_dir)
    return host_state_bytes(build_training(cfg, build_mesh(cfg.mesh), model_cls, model_cfg).abstract)


def one_case(config: str, size: str, seq_len: int, variant: str, warmup: int, steps: int) -> dict:
    """One row, in this process (raises on error)."""
    from mtraining_jax.train.plan import predicted_peak

    sets = case_overrides(size, variant)
    row = run_one(config, sets, seq_len, "mtraining", warmup=warmup, steps=steps)
    host = _host_bytes(config, sets, seq_len)
    ma = row.get("memory_analysis")
    plan = predicted_peak(ma, host) if ma else None
    peak = row.get("peak_bytes")
    row.update(size=size, variant=variant, fits=True, host_state_bytes=host, plan_peak_bytes=plan,
               plan_peak_gib=None if plan is None else plan / GIB,
               plan_error=None if plan is None or not peak else plan / peak - 1.0)
    return row


def _one_main(args) -> int:
    try:
        row = one_case(args.config, args.size, args.seq_len, args.variant, args.warmup, args.steps)
    except Exception as e:  # noqa: BLE001  (OOM, compile errors: all become rows)
        row = failure_row(args.size, args.seq_len, args.variant, f"{type(e).__name__}: {e}")
    sys.stdout.flush()
    print(json.dumps(row), flush=True)
    return 0


def failure_row(size: str, seq_len: int, variant: str, message: str) -> dict:
    """An error row; ``fits`` is False when the message is an out-of-memory error, else None."""
    row = error_row(seq_len, "mtraining", 1, message)
    row.update(size=size, variant=variant, fits=False if any(m in message for m in OOM_MARKERS) else None)
    return row


def run_child(args, size: str, seq_len: int, variant: str, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.memory_plan", "--one", "--config", args.config, "--size", size,
           "--seq-len", str(seq_len), "--variant", variant, "--warmup", str(args.warmup), "--steps", str(args.steps)]
    return _driver.run_child(cmd, REPO, timeout, lambda why: failure_row(size, seq_len, variant, why))


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: Sequence[dict]) -> str:
    """Markdown table, one line per case."""
    lines = ["| model | seq | remat | offload | fits | tokens/s | step s | peak GiB | plan GiB | plan error | compile s |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
    order = lambda r: (SIZES.index(r["size"]) if r.get("size") in SIZES else 9, r["seq_len"], r.get("variant", ""))  # noqa: E731
    for r in sorted(rows, key=order):
        remat, off = parse_variant(r["variant"]) if r.get("variant") else ("?", "")
        head = f"| {r.get('size')} | {r['seq_len']} | {remat} | {OFFLOADS[off]} "
        if r.get("error"):
            fits = {False: "**no** (OOM)", None: "error"}[r.get("fits")]
            msg = " ".join(str(r["error"]).split())[:120].replace("|", "/")
            lines.append(head + f"| {fits} | | | | | {msg} | |")
            continue
        err = r.get("plan_error")
        lines.append(head + f"| yes | {_f(r.get('tokens_per_s'), ',.0f')} | {_f(r.get('step_ms') and r['step_ms'] / 1e3, '.2f')} "
                     f"| {_f(r.get('peak_gib'), '.2f')} | {_f(r.get('plan_peak_gib'), '.2f')} "
                     f"| {'-' if err is None else f'{100 * err:+.1f}%'} | {_f(r.get('compile_s'), '.0f')} |")
    dev = sorted({r.get("device_kind") for r in rows if r.get("device_kind")})
    if dev:
        lines += ["", f"device: {', '.join(dev)}"]
    return "\n".join(lines)


def plot(rows: Sequence[dict], path: str, capacity_gib: Optional[float] = None) -> None:
    """Horizontal bars: measured peak GiB per case (hatched where it did not fit, at the capacity),
    the plan's prediction as a tick, the device's capacity as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = lambda r: (SIZES.index(r["size"]) if r.get("size") in SIZES else 9, r["seq_len"], r.get("variant", ""))  # noqa: E731
    rows = sorted([r for r in rows if r.get("fits") is not None], key=order)
    cap = capacity_gib or max([r.get("peak_gib") or 0 for r in rows] + [1.0])
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(rows) + 1.4))
    for y, r in enumerate(rows):
        fits = bool(r.get("fits"))
        ax.barh(y, r["peak_gib"] if fits else cap, color="tab:blue" if fits else "none",
                edgecolor="tab:blue" if fits else "tab:red", hatch=None if fits else "//")
        if r.get("plan_peak_gib"):
            ax.plot([r["plan_peak_gib"]] * 2, [y - 0.4, y + 0.4], color="black", lw=2)
        label = f"{r['tokens_per_s']:,.0f} tok/s" if fits and r.get("tokens_per_s") else "does not fit"
        ax.text((r["peak_gib"] if fits else cap) + 1, y, label, va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{r['size']} {r['seq_len'] // 1024}K {r.get('variant', '')}" for r in rows])
    if capacity_gib:
        ax.axvline(capacity_gib, color="tab:red", ls="--", lw=1)
    ax.invert_yaxis()
    ax.set_xlim(0, cap * 1.25)
    ax.set_xlabel("peak device memory, GiB (bar: measured; black tick: --plan; dashed: device)")
    ax.set_title("Qwen2.5 shapes on one GPU, MTraining attention")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _list(kind, allowed=None):
    def parse(text):
        vals = [kind(t.strip()) for t in text.split(",") if t.strip()]
        if not vals or (allowed and any(v not in allowed for v in vals)):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list from {allowed}, got {text!r}")
        return vals
    return parse


def _variants(text):
    vals = [t.strip() for t in text.split(",") if t.strip()]
    try:
        for v in vals:
            parse_variant(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--sizes", type=_list(str, SIZES), default=list(SIZES))
    p.add_argument("--seq-lens", type=_list(int), default=[65536, 131072])
    p.add_argument("--variants", type=_variants,
                   default=["save_attn", "selective", "full", "save_attn+offload", "selective+offload", "full+offload"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=450.0, help="seconds per case")
    p.add_argument("--time-budget", type=float, help="seconds for all cases (the rest become 'skipped' rows)")
    p.add_argument("--out", help="folder for memory_plan.jsonl / .md")
    p.add_argument("--report", nargs="+", metavar="JSONL", help="only print the table of saved rows")
    p.add_argument("--plot", metavar="PNG", help="with --report: also draw the rows' peaks")
    p.add_argument("--capacity-gib", type=float, help="with --plot: the device's memory (a line)")
    p.add_argument("--one", action="store_true", help="run one case here and print its JSON row")
    p.add_argument("--size", choices=SIZES)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--variant")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        rows = []
        for path in args.report:
            with open(path) as f:
                rows += [json.loads(line) for line in f if line.strip()]
        print(format_table(rows))
        if args.plot:
            plot(rows, args.plot, args.capacity_gib)
        return 0
    if args.one:
        if args.size is None or args.seq_len is None or args.variant is None:
            raise SystemExit("--one needs --size, --seq-len and --variant")
        return _one_main(args)
    command = " ".join(shlex.quote(a) for a in ["python -m benchmarks.memory_plan"] +
                       list(sys.argv[1:] if argv is None else argv))
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cases = [(size, S, v) for size in args.sizes for S in args.seq_lens for v in args.variants]

    def describe(c, row):
        status = row.get("error") or (f"{row['tokens_per_s']:,.0f} tokens/s, peak {_f(row.get('peak_gib'), '.2f')} "
                                      f"GiB, plan {_f(row.get('plan_peak_gib'), '.2f')} GiB")
        return f"{c[0]} S={c[1]} {c[2]}: {str(status)[:300]}"

    rows = drive(cases, lambda c, t: run_child(args, *c, t), lambda c, why: failure_row(*c, why),
                 timeout=args.timeout, time_budget=args.time_budget, out=args.out, name="memory_plan",
                 command=command, date=date, describe=describe, min_timeout=5)
    write_table(format_table(rows), args.out, "memory_plan", command, date)
    return 0


if __name__ == "__main__":
    sys.exit(main())
