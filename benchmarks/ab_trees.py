"""A/B of code trees on one machine: one benchmark command, run from inside each arm's tree, arms
alternating over rounds, with the code each run imported checked.

    python -m benchmarks.ab_trees --arm main=. --arm lse=../lse_tree --rounds 3 --out OUT \\
        --metric step_ms -- benchmarks.train_throughput --config configs/qwen2.5-0.5b-128k.yaml \\
        --seq-lens 131072 --backends mtraining --set 'model.dense_layers=[]' --out {out}

An arm may also be a setting rather than a tree: ``--env NAME:VAR=VALUE`` (repeatable) sets ``VAR`` in
arm ``NAME``'s runs only, e.g. one tree twice with and without XLA's command buffers::

    python -m benchmarks.ab_trees --arm off=. --arm graphs=. \\
        --env 'off:XLA_FLAGS=--xla_gpu_enable_command_buffer=' --out OUT --metric fb_ms --group-by family,impl \\
        -- benchmarks.kernels --seqs 131072 ... --json {out}/rows.json

Each run is ``python -m MODULE ARGS`` with the arm's tree as its working directory (``python -m``
imports from the current directory first: a ``PYTHONPATH`` pointing at another tree is not enough,
``results/training/train_throughput.md`` run 28), ``{out}`` in ``ARGS`` replaced by the run's own
folder under ``OUT``, and ``MTRAINING_COMMIT`` set to the tree's ``COMMIT`` file or ``git rev-parse``.
Before any run the arms must differ in :func:`benchmarks._driver.code_digest` or in their ``--env``
(``--allow-same-code`` for an A/A run); after each run every row that names its ``code`` must name its arm's.

Round ``r`` runs the arms in the order rotated by ``r`` (no arm always first). A run past ``--timeout``
stops the A/B (the arm's next run would be cut too; its rounds so far are kept), and with ``--budget`` a
round starts only if the longest round so far still fits (the rounds that ran are reported, not one
cut short by the caller's own limit). ``OUT/ab.jsonl`` and ``OUT/ab.md`` are rewritten after every round,
so a run killed from outside leaves the finished rounds' comparison. Rows (every ``.jsonl``
row, or a ``.json`` file's list or ``rows``, written under the run's folder) go to ``OUT/ab.jsonl``
with ``ab_arm``, ``ab_round``, ``ab_code``, ``ab_env``; ``OUT/ab.md`` compares each arm with the first one per
``--group-by`` group: the per-round paired differences of ``--metric`` (the arms of a round ran back
to back), their mean and 95 % t-interval (:func:`benchmarks.quality_stats.paired_interval`), and a
verdict that claims a difference only where the interval excludes zero.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Optional, Sequence

from benchmarks._driver import code_digest, git_commit
from benchmarks.quality_stats import paired_interval


def parse_arm(text: str) -> tuple[str, str]:
    """``NAME=DIR`` -> ``(NAME, absolute DIR)``; the directory must hold an ``mtraining_jax`` package."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--arm must be NAME=DIR, got {text!r}")
    path = os.path.abspath(path)
    if not os.path.isdir(os.path.join(path, "mtraining_jax")):
        raise ValueError(f"--arm {text!r}: {path} holds no mtraining_jax package")
    return name, path


def parse_env(text: str, arms: Sequence[str]) -> tuple[str, str, str]:
    """``NAME:VAR=VALUE`` -> ``(NAME, VAR, VALUE)`` for an arm ``NAME`` of ``arms``; ``VALUE`` may hold
    ``=`` and ``:`` (and be empty). ``PYTHONPATH`` is refused (an arm imports its own tree), and so is
    ``MTRAINING_COMMIT`` (the commit on the rows is the arm's tree's)."""
    name, sep, rest = text.partition(":")
    var, eq, value = rest.partition("=")
    if not sep or not eq or not name or not var:
        raise ValueError(f"--env must be NAME:VAR=VALUE, got {text!r}")
    if name not in arms:
        raise ValueError(f"--env {text!r}: no arm {name!r} (arms: {', '.join(arms)})")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", var):
        raise ValueError(f"--env {text!r}: {var!r} is not an environment variable name")
    if var == "PYTHONPATH":
        raise ValueError(f"--env {text!r}: PYTHONPATH would import another tree's code (give that tree as an arm)")
    if var == "MTRAINING_COMMIT":
        raise ValueError(f"--env {text!r}: MTRAINING_COMMIT is the arm's tree's commit (its COMMIT file or git)")
    return name, var, value


def tree_commit(path: str) -> str:
    """The commit a tree's code is: its ``COMMIT`` file (a tree copied without ``.git``), else
    ``git rev-parse --short=12 HEAD`` there (``+dirty`` with tracked changes), else ``unknown``."""
    f = os.path.join(path, "COMMIT")
    if os.path.isfile(f):
        return open(f).read().strip() or "unknown"
    return git_commit(path) or "unknown"


def read_rows(folder: str) -> list:
    """Every results row a run wrote under ``folder``: ``.jsonl`` lines, ``.json`` lists or ``rows``."""
    rows = []
    for d, _, names in sorted(os.walk(folder)):
        for n in sorted(names):
            p = os.path.join(d, n)
            if n.endswith(".jsonl"):
                rows += [json.loads(line) for line in open(p) if line.strip()]
            elif n.endswith(".json"):
                data = json.load(open(p))
                data = data.get("rows", []) if isinstance(data, dict) else data
                rows += [r for r in data if isinstance(r, dict)]
    return rows


def rounds_order(arms: Sequence[str], r: int) -> list:
    """Round ``r``'s order: the arms rotated left by ``r``."""
    k = r % len(arms)
    return list(arms[k:]) + list(arms[:k])


def compare(rows: list, arms: Sequence[str], metric: str, group_by: Sequence[str]) -> list:
    """Per group and arm (after the first): the first arm's and this arm's per-round values of
    ``metric`` (the median over the round's rows of the group), the paired differences
    ``arm - first`` by round, and their interval."""
    key = lambda r: tuple(r.get(g) for g in group_by)  # noqa: E731
    groups = sorted({key(r) for r in rows if isinstance(r.get(metric), (int, float))}, key=str)
    out = []
    for g in groups:
        per = {}
        for r in rows:
            if key(r) == g and isinstance(r.get(metric), (int, float)):
                per.setdefault((r["ab_arm"], r["ab_round"]), []).append(float(r[metric]))
        vals = {(a, rd): statistics.median(v) for (a, rd), v in per.items()}
        base = arms[0]
        for arm in arms[1:]:
            rds = sorted(rd for (a, rd) in vals if a == arm and (base, rd) in vals)
            iv = paired_interval([vals[(arm, rd)] - vals[(base, rd)] for rd in rds])
            out.append(dict(group=dict(zip(group_by, g)), arm=arm, base=base, rounds=rds,
                            base_values=[vals[(base, rd)] for rd in rds], values=[vals[(arm, rd)] for rd in rds],
                            diff=iv))
    return out


def verdict(iv: dict, metric: str) -> str:
    if iv["n"] == 0:
        return "no round with both arms: nothing compared"
    if iv["lo"] is None:
        return "one round: no interval, no difference established"
    if iv["hi"] < 0:
        return f"lower {metric} (interval excludes 0)"
    if iv["lo"] > 0:
        return f"higher {metric} (interval excludes 0)"
    return "no difference established (interval includes 0)"


def table(comparisons: list, metric: str) -> str:
    lines = [f"| group | arm | {metric}: base by round | arm by round | arm - base, mean [95 %] | verdict |",
             "|---|---|---|---|---|---|"]
    for c in comparisons:
        iv = c["diff"]
        g = ", ".join(f"{k}={v}" for k, v in c["group"].items()) or "all"
        ci = "-" if iv["mean"] is None else (
            f"{iv['mean']:+.3f}" + (f" [{iv['lo']:+.3f}, {iv['hi']:+.3f}]" if iv["lo"] is not None else ""))
        lines.append(f"| {g} | {c['arm']} vs {c['base']} | {', '.join(f'{x:.3f}' for x in c['base_values'])} | "
                     f"{', '.join(f'{x:.3f}' for x in c['values'])} | {ci} | {verdict(iv, metric)} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="python -m benchmarks.ab_trees --arm NAME=DIR --arm NAME=DIR [options] -- "
                                       "MODULE ARGS... (with {out} where the run's folder goes)")
    ap.add_argument("--arm", action="append", default=[], help="NAME=DIR, twice or more; the first is the base")
    ap.add_argument("--rounds", type=int, default=2, help="runs per arm, alternating (default 2)")
    ap.add_argument("--out", required=True, help="folder for the runs, ab.jsonl and ab.md")
    ap.add_argument("--metric", default="step_ms", help="the row field compared (default step_ms)")
    ap.add_argument("--group-by", default="", help="comma-separated row fields: one comparison per group "
                    "(e.g. index,pass_,impl for benchmarks.kernels --passes)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run (default 600)")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds for all rounds: a round starts only if the longest one so far fits (0: no limit)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME:VAR=VALUE",
                    help="set VAR to VALUE in arm NAME's runs only (repeatable): arms of one tree may differ by this")
    ap.add_argument("--allow-same-code", action="store_true",
                    help="let two arms run the same code with the same --env (an A/A run)")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("error: give the benchmark after '--': MODULE ARGS... (e.g. -- benchmarks.train_throughput "
                         "... --out {out})")
    cut = argv.index("--")
    a, command = build_parser().parse_args(argv[:cut]), argv[cut + 1:]
    if not command or command[0].startswith("-"):
        raise SystemExit(f"error: the command after '--' must start with a module name, got {command[:1]}")
    if not any("{out}" in x for x in command):
        raise SystemExit("error: the command must name the run's folder as {out} (e.g. --out {out}): rows are "
                         "read from there")
    if a.rounds < 1:
        raise SystemExit(f"error: --rounds must be >= 1, got {a.rounds}")
    if a.timeout <= 0 or a.budget < 0:
        raise SystemExit(f"error: --timeout must be > 0 and --budget >= 0, got {a.timeout} and {a.budget}")
    try:
        arms = dict(parse_arm(x) for x in a.arm)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if len(arms) < 2 or len(arms) != len(a.arm):
        raise SystemExit(f"error: need two or more --arm with distinct names, got {a.arm}")
    names = list(arms)
    arm_env = {n: {} for n in names}
    try:
        for x in a.env:
            n, var, value = parse_env(x, names)
            arm_env[n][var] = value
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    codes = {n: code_digest(p) for n, p in arms.items()}
    same = [(x, y) for i, x in enumerate(names) for y in names[i + 1:]
            if codes[x] == codes[y] and arm_env[x] == arm_env[y]]
    if same and not a.allow_same_code:
        raise SystemExit(f"error: arms {same} hold the same code ({', '.join(f'{n}: {codes[n]}' for n in names)}) "
                         "and the same --env; pass --allow-same-code for an A/A run")
    commits = {n: tree_commit(p) for n, p in arms.items()}
    os.makedirs(a.out, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    rows, t0, longest = [], time.time(), 0.0
    head = (f"`python -m benchmarks.ab_trees {' '.join(argv)}`\n\n"
            + "\n".join(f"* {n}: {arms[n]}, commit {commits[n]}, code {codes[n]}"
                        + "".join(f", `{k}={v}`" for k, v in arm_env[n].items()) for n in names) + "\n\n")

    def report(note: str = "") -> str:
        with open(os.path.join(a.out, "ab.jsonl"), "w") as f:
            for x in rows:
                f.write(json.dumps(x) + "\n")
        comp = compare(rows, names, a.metric, [g for g in a.group_by.split(",") if g])
        text = head + (f"{note}\n\n" if note else "") + table(comp, a.metric) + "\n"
        with open(os.path.join(a.out, "ab.md"), "w") as f:
            f.write(text)
        return text

    note = ""
    for r in range(a.rounds):
        elapsed = time.time() - t0
        if a.budget and r and elapsed + longest > a.budget:
            note = (f"Stopped before round {r}: {elapsed:.0f} s used, the longest round took {longest:.0f} s, "
                    f"--budget {a.budget:.0f} s.")
            print(note, file=sys.stderr, flush=True)
            break
        t_round, timed_out = time.time(), None
        for n in rounds_order(names, r):
            folder = os.path.abspath(os.path.join(a.out, f"r{r:02d}_{n}"))
            cmd = [sys.executable, "-m", command[0]] + [x.replace("{out}", folder) for x in command[1:]]
            os.makedirs(folder, exist_ok=True)  # there before the run: `--out {out}/rows.jsonl` works
            t = time.time()
            try:
                p = subprocess.run(cmd, cwd=arms[n], env={**env, "MTRAINING_COMMIT": commits[n], **arm_env[n]},
                                   capture_output=True, text=True, timeout=a.timeout)
                status = p.returncode
                log = (p.stdout or "") + (p.stderr or "")
            except subprocess.TimeoutExpired as e:
                status, log = "timeout", str(e)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "run.log"), "w") as f:
                f.write(log)
            got = read_rows(folder)
            wrong = sorted({x["code"] for x in got if x.get("code") not in (None, codes[n])})
            if wrong:
                raise SystemExit(f"error: arm {n} (code {codes[n]}) wrote rows of code {wrong}: it did not run "
                                 f"its own tree {arms[n]}")
            for x in got:
                x.update(ab_arm=n, ab_round=r, ab_code=codes[n], ab_tree=arms[n], ab_env=arm_env[n])
            rows += got
            print(f"[{time.time() - t0:7.1f}s] round {r} {n}: exit {status}, {len(got)} rows, "
                  f"{time.time() - t:.1f} s", file=sys.stderr, flush=True)
            if status != 0:
                print("\n".join(log.strip().splitlines()[-15:]), file=sys.stderr, flush=True)
            if status == "timeout":
                timed_out = n
                break
        longest = max(longest, time.time() - t_round)
        if timed_out:
            note = (f"Stopped in round {r}: arm {timed_out} ran past --timeout {a.timeout:.0f} s (its next run "
                    f"would too); rounds before it are compared.")
            print(note, file=sys.stderr, flush=True)
            break
        report()
    text = report(note)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
