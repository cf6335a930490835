"""``quality_study.py --gpu-per-seed``: one child process of the study per seed, each on its GPU
(``CUDA_VISIBLE_DEVICES``), at most one per GPU at a time; the parent merges the children's new rows
into ``--out/quality.jsonl`` and writes the comparison over seeds (:mod:`benchmarks.quality_seeds`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.quality_seeds import read_rows, write_seed_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the study script each child runs (with ``--child``)
STUDY_SCRIPT = os.path.join(ROOT, "benchmarks", "quality_study.py")

# options the parent of --gpu-per-seed sets for each child itself: name -> number of values ("+": one or more)
_PARENT_ONLY = {"--gpu-per-seed": 0, "--gpus": 1, "--seeds": "+", "--num-seeds": 1, "--seed": 1, "--out": 1}


def strip_parent_args(argv) -> list:
    """``argv`` without the options of :data:`_PARENT_ONLY` (``--opt value`` and ``--opt=value``)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        key = a.split("=", 1)[0]
        if key not in _PARENT_ONLY:
            out.append(a)
            i += 1
            continue
        i += 1
        if "=" in a or _PARENT_ONLY[key] == 0:
            continue
        if _PARENT_ONLY[key] == 1:
            i += 1
        else:
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
    return out


def child_commands(argv, seeds, gpus, out: str) -> list:
    """``[(seed, gpu, cmd, env, child_out)]``: one child per seed on GPU ``gpus[i % len(gpus)]``."""
    import shlex

    keep = strip_parent_args(list(argv))
    parent = " ".join(shlex.quote(a) for a in [sys.argv[0], *argv])
    jobs = []
    for i, s in enumerate(seeds):
        gpu = str(gpus[i % len(gpus)])
        child_out = os.path.join(out, f"seed{s}")
        cmd = [sys.executable, STUDY_SCRIPT, *keep, "--seeds", str(s), "--out", child_out, "--child"]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, MTRAINING_STUDY_COMMAND=parent)
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        jobs.append((s, gpu, cmd, env, child_out))
    return jobs


def launch_per_seed(args, argv, seeds) -> int:
    """Run one child per seed, at most one per GPU at a time; append their new rows to
    ``--out/quality.jsonl`` and write the comparison. Exit status 0 when every child succeeded."""
    gpus = args.gpus or [str(i) for i in range(len(seeds))]
    jobs = child_commands(argv, seeds, gpus, args.out)
    os.makedirs(args.out, exist_ok=True)
    offsets, pending, running, codes = {}, list(jobs), {}, {}
    t0 = time.time()
    while pending or running:
        busy = {j[1] for j in running.values()}
        for job in list(pending):
            if job[1] in busy:
                continue
            s, gpu, cmd, env, child_out = job
            os.makedirs(child_out, exist_ok=True)
            rows_file = os.path.join(child_out, "quality.jsonl")
            offsets[s] = os.path.getsize(rows_file) if os.path.isfile(rows_file) else 0
            log = open(os.path.join(child_out, f"log_{args.variant}.txt"), "a")
            print(f"[{time.time() - t0:6.0f}s] seed {s} on GPU {gpu}: {' '.join(cmd[1:])}", flush=True)
            running[s] = (subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), gpu, log)
            pending.remove(job)
            busy.add(gpu)
        time.sleep(0.5)
        for s, (proc, gpu, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                codes[s] = proc.returncode
                del running[s]
                print(f"[{time.time() - t0:6.0f}s] seed {s} (GPU {gpu}) exited with status {proc.returncode}",
                      flush=True)
    new = []
    for s, gpu, _, _, child_out in jobs:
        rows_file = os.path.join(child_out, "quality.jsonl")
        if os.path.isfile(rows_file):
            with open(rows_file) as f:
                f.seek(offsets[s])
                new += [line if line.endswith("\n") else line + "\n" for line in f if line.strip()]
        if codes.get(s):
            tail = open(os.path.join(child_out, f"log_{args.variant}.txt")).read().splitlines()[-15:]
            print(f"seed {s} failed; its log ends:\n" + "\n".join(tail), file=sys.stderr)
    with open(os.path.join(args.out, "quality.jsonl"), "a") as f:
        f.writelines(new)
    rows = read_rows([os.path.join(args.out, "quality.jsonl")])
    if rows:
        print(write_seed_report(rows, args.out))
    return 0 if all(c == 0 for c in codes.values()) else 1
