"""``quality_study.py --gpu-per-seed`` / ``--gpu-per-arm``: the study's children, each on one GPU
(``CUDA_VISIBLE_DEVICES``), at most one per GPU at a time; the parent merges the children's new rows
into ``--out/quality.jsonl`` (and ``pretrain.jsonl``) and writes the comparison over seeds
(:mod:`benchmarks.quality_seeds`).

* ``--gpu-per-seed``: one child per seed, running that seed's arms one after another.
* ``--gpu-per-arm``: one child per (seed, arm), and with copy pretraining first one ``--pretrain-only``
  child per seed; a seed's arms start on whichever GPU is free once its pretraining has finished (they
  reuse it from ``--work``). Three seeds x two arms after a copy pretraining on 4 GPUs: the three
  pretrainings at once, then the six arms as GPUs free up.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from benchmarks.quality_seeds import read_rows, write_seed_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the study script each child runs (with ``--child``)
STUDY_SCRIPT = os.path.join(ROOT, "benchmarks", "quality_study.py")

# options the parent sets for each child itself: name -> number of values ("+": one or more)
_PARENT_ONLY = {"--gpu-per-seed": 0, "--gpu-per-arm": 0, "--gpus": 1, "--seeds": "+", "--num-seeds": 1, "--seed": 1,
                "--out": 1}
_PARENT_ONLY_ARM = dict(_PARENT_ONLY, **{"--variant": 1})  # --gpu-per-arm: each child gets one arm


def add_launch_args(p) -> None:
    """The launcher's options on the study's parser."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gpu-per-seed", action="store_true",
                   help="one process per seed with CUDA_VISIBLE_DEVICES=<gpu>, all at once (waves if seeds > GPUs)")
    g.add_argument("--gpu-per-arm", action="store_true", help="one process per (seed, arm), after one per seed for "
                   "its copy pretraining; each on a free GPU (more parallel than --gpu-per-seed when GPUs > seeds)")
    p.add_argument("--gpus", type=lambda t: [x for x in t.split(",") if x],
                   help="GPU ids (default 0 .. seeds-1 with --gpu-per-seed; required with --gpu-per-arm)")


def strip_parent_args(argv, parent_only=None) -> list:
    """``argv`` without the options of ``parent_only`` (default :data:`_PARENT_ONLY`; ``--opt value``
    and ``--opt=value``)."""
    parent_only = _PARENT_ONLY if parent_only is None else parent_only
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        key = a.split("=", 1)[0]
        if key not in parent_only:
            out.append(a)
            i += 1
            continue
        i += 1
        if "=" in a or parent_only[key] == 0:
            continue
        if parent_only[key] == 1:
            i += 1
        else:
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
    return out


def _env(parent: str, gpu: str) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu), MTRAINING_STUDY_COMMAND=parent)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _parent_command(argv) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in [sys.argv[0], *argv])


def child_commands(argv, seeds, gpus, out: str) -> list:
    """``[(seed, gpu, cmd, env, child_out)]``: one child per seed on GPU ``gpus[i % len(gpus)]``."""
    keep, parent = strip_parent_args(list(argv)), _parent_command(argv)
    jobs = []
    for i, s in enumerate(seeds):
        gpu = str(gpus[i % len(gpus)])
        child_out = os.path.join(out, f"seed{s}")
        cmd = [sys.executable, STUDY_SCRIPT, *keep, "--seeds", str(s), "--out", child_out, "--child"]
        jobs.append((s, gpu, cmd, _env(parent, gpu), child_out))
    return jobs


@dataclass
class Job:
    """One child: ``name`` (``seed<s>-<arm>`` or ``seed<s>-pretrain``), its command, its folder, the
    names of the jobs it waits for, and where it may run (``gpu``: one GPU; ``None``: any free one)."""
    name: str
    cmd: list
    out: str
    deps: tuple = ()
    gpu: str | None = None
    code: int | None = field(default=None, compare=False)


def arm_jobs(argv, seeds, arms, pretraining: bool, pretrain_only: bool, out: str) -> list:
    """The ``--gpu-per-arm`` jobs: every seed's pretraining first (when ``pretraining``: they run at once),
    then the arms, arm by arm in ``arms`` order (dense first: the slowest arm starts first), each waiting
    for its seed's pretraining."""
    if pretrain_only and not pretraining:
        raise SystemExit("quality_study: --pretrain-only with --gpu-per-arm needs copy pretraining (--pretrain-steps)")
    keep = strip_parent_args(list(argv), _PARENT_ONLY_ARM)
    base = [sys.executable, STUDY_SCRIPT, *keep]
    jobs = []
    if pretraining:
        for s in seeds:
            o = os.path.join(out, f"seed{s}", "pretrain")
            jobs.append(Job(f"seed{s}-pretrain", base + ["--variant", arms[0], "--seeds", str(s), "--out", o,
                                                         "--child", "--pretrain-only"], o))
    for arm in () if pretrain_only else arms:
        for s in seeds:
            o = os.path.join(out, f"seed{s}", arm)
            jobs.append(Job(f"seed{s}-{arm}", base + ["--variant", arm, "--seeds", str(s), "--out", o, "--child"], o,
                            (f"seed{s}-pretrain",) if pretraining else ()))
    return jobs


def run_jobs(jobs, gpus, parent: str, log_name, poll: float = 0.5) -> dict:
    """Run ``jobs`` (:class:`Job`), at most one per GPU of ``gpus`` at a time, each as soon as its
    dependencies have succeeded and a GPU it may use is free (in list order); a job whose dependency
    failed is not run (code -1). ``log_name(job)``: its log file's name in ``job.out``. Returns
    ``{name: exit status}``."""
    pending, running, done = list(jobs), {}, {}
    t0 = time.time()
    while pending or running:
        for job in list(pending):
            if any(done.get(d, 0) != 0 for d in job.deps):
                print(f"[{time.time() - t0:6.0f}s] {job.name}: not run ({', '.join(job.deps)} failed)", flush=True)
                done[job.name] = job.code = -1
                pending.remove(job)
                continue
            if any(d not in done for d in job.deps):
                continue
            free = [g for g in gpus if g not in {j.gpu for j, _, _ in running.values()}]
            if job.gpu is not None:
                free = [g for g in free if g == job.gpu]
            if not free:
                continue
            job.gpu = free[0]
            os.makedirs(job.out, exist_ok=True)
            log = open(os.path.join(job.out, log_name(job)), "a")
            print(f"[{time.time() - t0:6.0f}s] {job.name} on GPU {job.gpu}: {' '.join(job.cmd[1:])}", flush=True)
            proc = subprocess.Popen(job.cmd, env=_env(parent, job.gpu), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            running[job.name] = (job, proc, log)
            pending.remove(job)
        if running:
            time.sleep(poll)
        for name, (job, proc, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                done[name] = job.code = proc.returncode
                del running[name]
                print(f"[{time.time() - t0:6.0f}s] {name} (GPU {job.gpu}) exited with status {proc.returncode}",
                      flush=True)
                if proc.returncode:
                    tail = open(os.path.join(job.out, log_name(job))).read().splitlines()[-15:]
                    print(f"{name} failed; its log ends:\n" + "\n".join(tail), file=sys.stderr)
    return done


def _offsets(jobs, files) -> dict:
    return {(j.name, f): os.path.getsize(os.path.join(j.out, f)) if os.path.isfile(os.path.join(j.out, f)) else 0
            for j in jobs for f in files}


def _merge(jobs, offsets, out: str, files) -> None:
    """Append each job's rows written since ``offsets`` to ``out``'s files of the same names."""
    for f in files:
        new = []
        for j in jobs:
            path = os.path.join(j.out, f)
            if os.path.isfile(path):
                with open(path) as fh:
                    fh.seek(offsets[(j.name, f)])
                    new += [line if line.endswith("\n") else line + "\n" for line in fh if line.strip()]
        if new:
            with open(os.path.join(out, f), "a") as fh:
                fh.writelines(new)


def _finish(jobs, offsets, out: str, files, codes) -> int:
    _merge(jobs, offsets, out, files)
    rows = read_rows([os.path.join(out, "quality.jsonl")]) if os.path.isfile(os.path.join(out, "quality.jsonl")) else []
    if rows:
        print(write_seed_report(rows, out))
    return 0 if all(c == 0 for c in codes.values()) else 1


def launch_per_seed(args, argv, seeds) -> int:
    """Run one child per seed, at most one per GPU at a time; append their new rows to
    ``--out/quality.jsonl`` and write the comparison. Exit status 0 when every child succeeded."""
    gpus = args.gpus or [str(i) for i in range(len(seeds))]
    jobs = [Job(f"seed{s}", cmd, child_out, gpu=gpu) for s, gpu, cmd, _, child_out in
            child_commands(argv, seeds, gpus, args.out)]
    os.makedirs(args.out, exist_ok=True)
    files = ("quality.jsonl", "pretrain.jsonl")
    offsets = _offsets(jobs, files)
    codes = run_jobs(jobs, list(dict.fromkeys(gpus)), _parent_command(argv), lambda j: f"log_{args.variant}.txt")
    return _finish(jobs, offsets, args.out, files, codes)


def launch_per_arm(args, argv, seeds, arms) -> int:
    """``--gpu-per-arm`` (:func:`arm_jobs`, :func:`run_jobs`): rows merged into ``--out`` as with
    ``--gpu-per-seed``. Exit status 0 when every child succeeded."""
    if not args.gpus:
        raise SystemExit("quality_study: --gpu-per-arm needs --gpus (e.g. --gpus 0,1,2,3)")
    if args.pretrain_seed is not None:
        raise SystemExit("quality_study: --pretrain-seed with --gpu-per-arm: every seed's arms would pretrain one "
                         "folder at once; give each seed its own pretraining (drop --pretrain-seed)")
    jobs = arm_jobs(argv, seeds, arms, bool(args.pretrain["steps"]), args.pretrain_only, args.out)
    os.makedirs(args.out, exist_ok=True)
    files = ("quality.jsonl", "pretrain.jsonl")
    offsets = _offsets(jobs, files)
    codes = run_jobs(jobs, list(dict.fromkeys(args.gpus)), _parent_command(argv), lambda j: "log.txt")
    return _finish(jobs, offsets, args.out, files, codes)
