"""Issue 34's kernel targets checked against one run's comparison-table rows (``benchmarks/kernels.py --json`` or a
results ``.jsonl`` with a ``run`` field; repeated calls of one run told apart by ``round``): each target per case
with the median value, the interval its repeats allow (the rows' ``fb_spread_ms`` / ``fwd_spread_ms``: fastest
and slowest repeat; over all rounds where there are several) and a verdict that claims ``met`` or ``not met``
only where the whole interval lies on one side of the target (``tie`` otherwise).

Targets (at 128K unless said): fwd+bwd >= 400 TFLOP/s on the active work and >= 16x cuDNN's dense causal
fwd+bwd at 5 % density (``density`` within 4-6.5 %: the trained model's layer-1 index at its own budget is
6.1 %); Mosaic >= 1.2x Triton on the same index; >= 350 TFLOP/s at
2 % (1.5-2.5 %); on the full causal index at 32K, forward >= 0.95x and fwd+bwd >= 0.9x cuDNN; training
(``benchmarks/train_throughput.py`` rows, 128K, every layer sparse): >= 4.5x the all-cuDNN step, peak <= 1.05x
cuDNN's, compile <= 20 s. The Mosaic rows are ``auto_*`` / ``mosaic_*`` as built (rows with a ``[...]`` option
tag are left out unless ``tag`` names it). ``benchmarks/kernel_targets_run.py`` measures them all in one command.

Usage: ``python -m benchmarks.kernel_targets results/kernels/kernels_v34.jsonl --runs v34_families,v34_full32``.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.kernels_report import load_rows

TARGETS = {"tflops_5": 400.0, "x_cudnn_5": 16.0, "x_triton": 1.2, "tflops_2": 350.0, "full_fwd": 0.95,
           "full_fb": 0.9, "train_x_cudnn": 4.5, "train_peak": 1.05, "train_compile_s": 20.0}
TRAIN_SEQ = 131072  # the training targets' sequence length (Qwen2.5-0.5B shape, every layer sparse)
DENSITY = {"5": (0.04, 0.065), "2": (0.015, 0.025)}


def _ms(r, key):
    """``(median, fastest, slowest)`` ms of row ``r``'s ``fb`` or ``fwd`` timing."""
    lo, hi = r.get(f"{key}_spread_ms") or (r[f"{key}_ms"], r[f"{key}_ms"])
    return r[f"{key}_ms"], lo, hi


def _verdict(lo, hi, target, at_most: bool = False) -> str:
    """``met`` / ``not met`` where the whole interval ``[lo, hi]`` lies on one side of ``target`` (at least it;
    ``at_most``: at most it), else ``tie``."""
    if at_most:
        return "met" if hi <= target else "not met" if lo > target else "tie"
    return "met" if lo >= target else "not met" if hi < target else "tie"


def _mosaic(r, tag: str) -> bool:
    impl, _, rest = r["name"].partition("_")
    base, _, opts = impl.partition("[")
    return base in ("auto", "mosaic") and (opts.rstrip("]") == tag)


def check(rows, tag: str = "") -> list[dict]:
    """One dict per (target, case): ``target``, ``case``, ``value`` (median), ``interval`` ``(lo, hi)``,
    ``goal``, ``verdict``, ``rounds``. ``tag``: the Mosaic rows' option tag to check (``""``: as built; e.g.
    ``"dkv=shared"`` for ``auto[dkv=shared]_*``). Rows of several runs are checked per run (``run``); a run's
    repeated calls (rows with a ``round`` field, each round its own cuDNN / Triton / Mosaic rows) are checked per
    round and pooled by :func:`pool`."""
    out = []
    for run, rnd in dict.fromkeys((r.get("run", ""), r.get("round")) for r in rows):
        rr = [r for r in rows if r.get("run", "") == run and r.get("round") == rnd]
        kr = [r for r in rr if "name" in r]  # the kernel table's rows (training rows name a backend)
        cud = {r["seq"]: r for r in kr if r["name"] == "cudnn"}
        tri = {(r["seq"], r["name"].partition("_")[2]): r for r in kr if r["name"].startswith("triton_")}

        def add(target, case, value, lo, hi, goal):
            out.append(dict(run=run, target=target, case=case, value=value, interval=(lo, hi), goal=goal,
                            verdict=_verdict(lo, hi, goal), rounds=[value]))

        for r in kr:
            if not _mosaic(r, tag):
                continue
            case, S = r["name"].partition("_")[2], r["seq"]
            if case == "full" and S == 32768 and S in cud:
                for key, name in (("fwd", "full_fwd"), ("fb", "full_fb")):
                    m, lo, hi = _ms(r, key)
                    cm, clo, chi = _ms(cud[S], key)
                    add(f"{key} x cuDNN, full 32K", case, cm / m, clo / hi, chi / lo, TARGETS[name])
                continue
            if S != 131072 or not r.get("fb_ms"):
                continue
            m, lo, hi = _ms(r, "fb")
            flop = r["fb_tflops"] * m  # TFLOP/s x ms: the same work at any time
            for pct, (dlo, dhi) in DENSITY.items():
                if not dlo <= r["density"] <= dhi:
                    continue
                add(f"TFLOP/s at {pct} %", case, r["fb_tflops"], flop / hi, flop / lo, TARGETS[f"tflops_{pct}"])
                if pct == "5" and S in cud:
                    cm, clo, chi = _ms(cud[S], "fb")
                    add("x cuDNN at 5 %", case, cm / m, clo / hi, chi / lo, TARGETS["x_cudnn_5"])
            if (S, case) in tri:
                tm, tlo, thi = _ms(tri[S, case], "fb")
                add("x Triton", case, tm / m, tlo / hi, thi / lo, TARGETS["x_triton"])
        out += _train_targets(rr, run)
    return pool(out)


def _train_targets(rows, run) -> list[dict]:
    """The training targets from one round's ``benchmarks/train_throughput.py`` rows at 128K (``backend``
    ``mtraining`` and ``cudnn``, no ``error``): the every-layer-sparse step's speed-up over the all-cuDNN step
    (medians; the interval from single steps, ``step_ms_all``), its peak memory over cuDNN's and its compile."""
    by = {r["backend"]: r for r in rows if r.get("seq_len") == TRAIN_SEQ and r.get("step_ms") and not r.get("error")}
    if "mtraining" not in by or "cudnn" not in by:
        return []
    mt, cud = by["mtraining"], by["cudnn"]
    ms, cs = mt.get("step_ms_all") or [mt["step_ms"]], cud.get("step_ms_all") or [cud["step_ms"]]
    peak = mt["peak_gib"] / cud["peak_gib"]

    def entry(target, value, lo, hi, goal, at_most=False):
        return dict(run=run, target=target, case="train 128K", value=value, interval=(lo, hi), goal=goal,
                    verdict=_verdict(lo, hi, goal, at_most), rounds=[value], at_most=at_most)

    return [entry("train x all-cuDNN", cud["step_ms"] / mt["step_ms"], min(cs) / max(ms), max(cs) / min(ms),
                  TARGETS["train_x_cudnn"]),
            entry("train peak / cuDNN's", peak, peak, peak, TARGETS["train_peak"], at_most=True),
            entry("train compile s", mt["compile_s"], mt["compile_s"], mt["compile_s"], TARGETS["train_compile_s"],
                  at_most=True)]


def pool(checked) -> list[dict]:
    """One entry per (run, target, case) from the per-round entries of :func:`check`: ``value`` the median of the
    rounds' values (``rounds`` lists them in order), ``interval`` from the lowest round's low end to the highest
    round's high end, and the verdict on that whole interval (``met`` only if every round's interval is)."""
    groups: dict = {}
    for c in checked:
        groups.setdefault((c["run"], c["target"], c["case"]), []).append(c)
    out = []
    for cs in groups.values():
        values = [v for c in cs for v in c["rounds"]]
        lo, hi = min(c["interval"][0] for c in cs), max(c["interval"][1] for c in cs)
        out.append(dict(cs[0], value=statistics.median(values), interval=(lo, hi), rounds=values,
                        verdict=_verdict(lo, hi, cs[0]["goal"], cs[0].get("at_most", False))))
    return out


def table(checked) -> str:
    lines = ["| run | target | case | median | interval (repeats) | goal | verdict | rounds |",
             "|---|---|---|---:|---|---:|---|---|"]
    for c in checked:
        lo, hi = c["interval"]
        rounds = " / ".join(f"{v:.2f}" for v in c["rounds"]) if len(c["rounds"]) > 1 else ""
        lines.append(f"| {c['run']} | {c['target']} | {c['case']} | {c['value']:.2f} | {lo:.2f}-{hi:.2f} | "
                     f"{c['goal']:g} | {c['verdict']} | {rounds} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="--json output (.json) or results rows (.jsonl)")
    ap.add_argument("--runs", default="", help="comma-separated run tags to keep (.jsonl rows)")
    ap.add_argument("--tag", default="", help="the Mosaic rows' option tag, e.g. dkv=shared (default: as built)")
    a = ap.parse_args(argv)
    rows = [r for r in load_rows(a.files, [x for x in a.runs.split(",") if x]) if "fwd_ms" in r or "backend" in r]
    checked = check(rows, a.tag)
    if not checked:
        ap.error("no Mosaic rows at 128K (5 % / 2 %) or of the full index at 32K, and no training rows of both "
                 "backends at 128K, in those rows")
    print(table(checked))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
