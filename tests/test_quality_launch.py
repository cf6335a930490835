"""benchmarks/quality_launch.py: the study's children on GPUs (``--gpu-per-seed``: one per seed;
``--gpu-per-arm``: one per seed's copy pretraining, then one per (seed, arm) once it has finished), with
stand-in children that write rows, so the scheduling, the command lines and the merged rows are checked
on the CPU."""

import json
import os
import sys

import pytest

from benchmarks import quality_launch, quality_study

# a stand-in for quality_study.py as a child: a --pretrain-only child sleeps, marks its seed done (or fails for
# seed FAIL_SEED) and writes a pretrain row; an arm child checks its seed's mark and writes a quality row with
# its GPU and its start time
CHILD = """
import json, os, sys, time
a = sys.argv
out = a[a.index('--out') + 1]; seed = int(a[a.index('--seeds') + 1]); arm = a[a.index('--variant') + 1]
os.makedirs(out, exist_ok=True)
marks = os.environ['MARKS']
if '--pretrain-only' in a:
    time.sleep(0.4 + 0.2 * seed)
    if seed == int(os.environ.get('FAIL_SEED', -1)):
        sys.exit(5)
    open(os.path.join(marks, f'pre{seed}'), 'w').write(str(time.time()))
    open(os.path.join(out, 'pretrain.jsonl'), 'a').write(json.dumps(dict(arm='pretrain', seed=seed)) + '\\n')
    sys.exit(0)
if not os.path.exists(os.path.join(marks, f'pre{seed}')):
    sys.exit(3)  # started before its pretraining finished
t = time.time(); time.sleep(0.3)
row = dict(arm=arm, variant=arm, seed=seed, steps=2, tokens=1024, tokens_per_step=512,
           heldout_loss=2.0 + seed - 0.1 * (arm == 'mtraining'), niah_accuracy=0.5, recall=0.8, commit='c', date='d',
           device='gpu', jax='j', command=os.environ['MTRAINING_STUDY_COMMAND'], corpus_sha=str(seed),
           gpu=os.environ['CUDA_VISIBLE_DEVICES'], start=t, argv=a[1:], train_loss=[[1, 3.0], [2, 2.5]],
           heldout_curve=[[2, 2.6]], train_time=[[1, 1.0], [2, 2.0]])
open(os.path.join(out, 'quality.jsonl'), 'a').write(json.dumps(row) + '\\n')
"""


def test_gpu_per_seed_launches_one_process_per_seed(tmp_path, monkeypatch):
    argv = ["--out", str(tmp_path / "out"), "--variant", "dense", "--num-seeds", "5", "--gpu-per-seed",
            "--gpus=0,1,2,3", "--work", "/tmp/w", "--seeds", "7", "8"]
    jobs = quality_launch.child_commands(argv, [0, 1, 2, 3, 4], ["0", "1", "2", "3"], str(tmp_path / "out"))
    assert [j[1] for j in jobs] == ["0", "1", "2", "3", "0"]  # a fifth seed waits for GPU 0
    for s, gpu, cmd, env, child_out in jobs:
        assert env["CUDA_VISIBLE_DEVICES"] == gpu and child_out == str(tmp_path / "out" / f"seed{s}")
        assert cmd[2:] == ["--variant", "dense", "--work", "/tmp/w", "--seeds", str(s), "--out", child_out, "--child"]
        assert "--gpu-per-seed" in env["MTRAINING_STUDY_COMMAND"]
    # the launcher with stand-in children that write one row each: rows merged, comparison written
    child = tmp_path / "child.py"
    child.write_text(
        "import json, os, sys\n"
        "out = sys.argv[sys.argv.index('--out') + 1]; seed = int(sys.argv[sys.argv.index('--seeds') + 1])\n"
        "os.makedirs(out, exist_ok=True)\n"
        "arm = sys.argv[sys.argv.index('--variant') + 1]\n"
        "row = dict(arm=arm, variant=arm, seed=seed, steps=2, tokens=1024, tokens_per_step=512,\n"
        "           heldout_loss=2.0 + seed - 0.1 * (arm == 'mtraining'), niah_accuracy=0.0, recall=0.8, commit='c', date='d', device='gpu',\n"
        "           jax='j', command=os.environ['MTRAINING_STUDY_COMMAND'], corpus_sha=str(seed),\n"
        "           gpu=os.environ['CUDA_VISIBLE_DEVICES'], train_loss=[[1, 3.0], [2, 2.5]],\n"
        "           heldout_curve=[[2, 2.6]], train_time=[[1, 1.0], [2, 2.0]])\n"
        "open(os.path.join(out, 'quality.jsonl'), 'a').write(json.dumps(row) + '\\n')\n")
    real = quality_launch.child_commands
    monkeypatch.setattr(quality_launch, "child_commands", lambda *a: [
        (s, g, [sys.executable, str(child), *c[2:]], e, o) for s, g, c, e, o in real(*a)])
    out = str(tmp_path / "run")
    assert quality_study.main(["--out", out, "--variant", "dense", "--seeds", "0", "1", "--gpu-per-seed"]) == 0
    assert quality_study.main(["--out", out, "--variant", "dense", "--seeds", "2", "--gpu-per-seed"]) == 0
    assert quality_study.main(["--out", out, "--variant", "mtraining", "--seeds", "0", "1", "--gpu-per-seed"]) == 0
    rows = [json.loads(line) for line in open(os.path.join(out, "quality.jsonl"))]
    assert sorted((r["arm"], r["seed"], r["gpu"]) for r in rows) == [  # every row once, each on its GPU
        ("dense", 0, "0"), ("dense", 1, "1"), ("dense", 2, "0"), ("mtraining", 0, "0"), ("mtraining", 1, "1")]
    assert len(open(tmp_path / "run" / "seed0" / "quality.jsonl").readlines()) == 2  # the child's own file
    md = open(os.path.join(out, "seeds.md")).read()
    assert "| dense | 0, 1, 2 | 3.0000 ± 1.0000 |" in md and os.path.isfile(os.path.join(out, "loss_vs_tokens.png"))
    assert "| mtraining − dense | 2 | -0.1 | [-0.1, -0.1] | s0: -0.1, s1: -0.1 | lower than dense" in md


def _stand_in(tmp_path, monkeypatch):
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setattr(quality_launch, "STUDY_SCRIPT", str(child))
    monkeypatch.setenv("MARKS", str(marks))
    return marks


def test_gpu_per_arm_jobs():
    argv = ["--out", "o", "--variant", "both", "--seeds", "0", "1", "--gpu-per-arm", "--gpus", "0,1,2",
            "--work", "/tmp/w", "--pretrain-steps", "4000", "--set", "optim.lr=3e-4"]
    jobs = quality_launch.arm_jobs(argv, [0, 1], ("dense", "mtraining"), True, False, "o")
    assert [j.name for j in jobs] == ["seed0-pretrain", "seed1-pretrain", "seed0-dense", "seed1-dense",
                                      "seed0-mtraining", "seed1-mtraining"]  # the pretrainings first, then arm by arm
    keep = ["--work", "/tmp/w", "--pretrain-steps", "4000", "--set", "optim.lr=3e-4"]
    assert jobs[1].cmd[2:] == keep + ["--variant", "dense", "--seeds", "1", "--out", os.path.join("o", "seed1", "pretrain"),
                                      "--child", "--pretrain-only"] and jobs[1].deps == ()
    assert jobs[4].cmd[2:] == keep + ["--variant", "mtraining", "--seeds", "0", "--out",
                                      os.path.join("o", "seed0", "mtraining"), "--child"]
    assert jobs[4].deps == ("seed0-pretrain",) and all(j.gpu is None for j in jobs)
    # without copy pretraining: the arms alone, nothing to wait for
    jobs = quality_launch.arm_jobs(argv, [0], ("dense", "mtraining"), False, False, "o")
    assert [(j.name, j.deps) for j in jobs] == [("seed0-dense", ()), ("seed0-mtraining", ())]
    with pytest.raises(SystemExit, match="needs copy pretraining"):
        quality_launch.arm_jobs(argv, [0], ("dense",), False, True, "o")


def test_gpu_per_arm_runs_the_arms_after_their_pretraining_on_free_gpus(tmp_path, monkeypatch):
    marks = _stand_in(tmp_path, monkeypatch)
    out = str(tmp_path / "run")
    argv = ["--out", out, "--variant", "both", "--seeds", "0", "1", "2", "--gpu-per-arm", "--gpus", "0,1,2,3",
            "--pretrain-steps", "10", "--work", str(tmp_path / "w")]
    assert quality_study.main(argv) == 0
    rows = [json.loads(line) for line in open(os.path.join(out, "quality.jsonl"))]
    assert sorted((r["arm"], r["seed"]) for r in rows) == [(a, s) for a in ("dense", "mtraining") for s in (0, 1, 2)]
    for r in rows:  # each arm after its own seed's pretraining, on one GPU, with the parent's command
        assert r["start"] >= float(open(marks / f"pre{r['seed']}").read())
        assert r["argv"][r["argv"].index("--out") + 1] == os.path.join(out, f"seed{r['seed']}", r["arm"])
        assert "--gpu-per-arm" in r["command"] and "--gpu-per-arm" not in r["argv"]
    assert "3" in {r["gpu"] for r in rows}  # the fourth GPU took arms while the pretrainings held the others
    by_gpu = {}
    for r in rows:
        by_gpu.setdefault(r["gpu"], []).append(r["start"])
    assert sum(len(v) for v in by_gpu.values()) == 6 and len(by_gpu) == 4
    assert len(open(os.path.join(out, "pretrain.jsonl")).readlines()) == 3  # the pretrain rows merged too
    md = open(os.path.join(out, "seeds.md")).read()
    assert "| mtraining − dense | 3 | -0.1 |" in md


def test_gpu_per_arm_skips_the_arms_of_a_failed_pretraining(tmp_path, monkeypatch, capsys):
    _stand_in(tmp_path, monkeypatch)
    monkeypatch.setenv("FAIL_SEED", "1")
    out = str(tmp_path / "run")
    argv = ["--out", out, "--variant", "both", "--seeds", "0", "1", "--gpu-per-arm", "--gpus", "0,1",
            "--pretrain-steps", "10", "--work", str(tmp_path / "w")]
    assert quality_study.main(argv) == 1
    rows = [json.loads(line) for line in open(os.path.join(out, "quality.jsonl"))]
    assert sorted((r["arm"], r["seed"]) for r in rows) == [("dense", 0), ("mtraining", 0)]
    captured = capsys.readouterr()
    assert "seed1-dense: not run (seed1-pretrain failed)" in captured.out
    assert "seed1-pretrain failed; its log ends" in captured.err
    with pytest.raises(SystemExit, match="needs --gpus"):
        quality_study.main(["--out", out, "--seeds", "0", "--gpu-per-arm"])
    with pytest.raises(SystemExit, match="--pretrain-seed with --gpu-per-arm"):
        quality_study.main(["--out", out, "--seeds", "0", "--gpu-per-arm", "--gpus", "0", "--pretrain-steps", "10",
                            "--pretrain-seed", "0"])
    with pytest.raises(SystemExit):  # one launcher at a time
        quality_study.main(["--out", out, "--seeds", "0", "--gpu-per-arm", "--gpu-per-seed", "--gpus", "0"])
