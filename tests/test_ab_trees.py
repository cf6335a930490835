"""benchmarks.ab_trees: each arm runs from inside its own tree (the rows name their code), arms
alternate by round, the comparison is paired by round and claims a difference only where its
interval excludes zero; arms of one tree may differ by their environment (--env); same-code arms with the
same environment, rows of another code, a bad --env and a command without {out} are refused."""

import json
import os
import shutil
import subprocess
import sys

from benchmarks import _driver, ab_trees

FAKE = '''"""A stand-in benchmark: one row with this tree's metric and the code it imported."""
import json, os, sys
from benchmarks._driver import provenance
out = sys.argv[sys.argv.index("--out") + 1]
os.makedirs(out, exist_ok=True)
rnd = len([d for d in os.listdir(os.path.dirname(out))])  # a little drift between runs
import time; time.sleep(SLEEP)
row = dict(provenance(sys.argv[1:]), step_ms=BASE + 0.01 * rnd + float(os.environ.get("AB_SHIFT", "0")), index="a",
           probe=os.environ.get("AB_PROBE"))
if CLAIM:
    row["code"] = CLAIM
with open(os.path.join(out, "rows.jsonl"), "w") as f:
    f.write(json.dumps(row) + "\\n")
    f.write(json.dumps(dict(row, index="b", step_ms=row["step_ms"] * 2)) + "\\n")
'''


def _tree(root, name, base, claim="", sleep=0.0):
    t = root / name
    src = _driver.code_root()
    for pkg in _driver.CODE_PACKAGES:
        shutil.copytree(os.path.join(src, pkg), t / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (t / "benchmarks" / "fake_bench.py").write_text(FAKE.replace("BASE", repr(base)).replace("CLAIM", repr(claim))
                                                          .replace("SLEEP", repr(sleep)))
    (t / "COMMIT").write_text(f"c-{name}\n")
    return t


def _run(args, cwd):
    return subprocess.run([sys.executable, "-m", "benchmarks.ab_trees", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})


def test_arms_run_their_own_trees_alternating_and_paired(tmp_path):
    a, b = _tree(tmp_path, "a", 12.0), _tree(tmp_path, "b", 10.0)
    out = tmp_path / "out"
    p = _run([f"--arm=main={a}", f"--arm=new={b}", "--rounds", "3", "--out", str(out), "--group-by", "index",
              "--", "benchmarks.fake_bench", "--out", "{out}"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in open(out / "ab.jsonl")]
    assert [(r["ab_round"], r["ab_arm"]) for r in rows][::2] == [(0, "main"), (0, "new"), (1, "new"), (1, "main"),
                                                                  (2, "main"), (2, "new")]
    codes = {r["ab_arm"]: r["code"] for r in rows}
    assert codes == {"main": _driver.code_digest(str(a)), "new": _driver.code_digest(str(b))}
    assert codes["main"] != codes["new"]
    assert {r["ab_arm"]: r["commit"] for r in rows} == {"main": "c-a", "new": "c-b"}
    md = open(out / "ab.md").read()
    assert f"code {codes['main']}" in md and "commit c-b" in md
    line_a = next(x for x in md.splitlines() if x.startswith("| index=a |"))
    assert "new vs main" in line_a and "lower step_ms (interval excludes 0)" in line_a
    mean, lo, hi = (float(x) for x in line_a.split("|")[5].replace("[", " ").replace("]", " ").replace(",", " ").split())
    assert abs(mean + 2.0) < 0.02 and lo < mean < hi < 0, line_a  # the per-round paired difference
    assert "lower step_ms" in next(x for x in md.splitlines() if x.startswith("| index=b |"))


def test_refusals(tmp_path):
    a = _tree(tmp_path, "a", 1.0)
    b = _tree(tmp_path, "b", 1.0)  # the same sources as a (the fake module is identical): an A/A
    out = str(tmp_path / "out")
    p = _run([f"--arm=x={a}", f"--arm=y={b}", "--out", out, "--", "benchmarks.fake_bench", "--out", "{out}"], tmp_path)
    assert p.returncode == 1 and "hold the same code" in p.stderr and "--allow-same-code" in p.stderr, p.stderr
    p = _run([f"--arm=x={a}", f"--arm=y={b}", "--out", out, "--rounds", "1", "--allow-same-code", "--",
              "benchmarks.fake_bench", "--out", "{out}"], tmp_path)
    assert p.returncode == 0 and "one round: no interval" in p.stdout, p.stderr[-2000:]
    c = _tree(tmp_path, "c", 1.0, claim="0123456789ab")  # writes rows naming other code
    p = _run([f"--arm=x={a}", f"--arm=z={c}", "--out", out, "--", "benchmarks.fake_bench", "--out", "{out}"], tmp_path)
    assert p.returncode == 1 and "wrote rows of code ['0123456789ab']" in p.stderr, p.stderr[-2000:]
    for args, msg in (([f"--arm=x={a}", f"--arm=y={b}", "--out", out, "--", "benchmarks.fake_bench"], "{out}"),
                      ([f"--arm=x={a}", f"--arm=y={b}", "--out", out], "after '--'"),
                      ([f"--arm=x={a}", "--out", out, "--", "m", "{out}"], "two or more --arm"),
                      ([f"--arm=x={a}", f"--arm=x={b}", "--out", out, "--", "m", "{out}"], "distinct names"),
                      ([f"--arm=x={tmp_path}", f"--arm=y={b}", "--out", out, "--", "m", "{out}"], "no mtraining_jax"),
                      (["--arm=x", f"--arm=y={b}", "--out", out, "--", "m", "{out}"], "NAME=DIR"),
                      ([f"--arm=x={a}", f"--arm=y={b}", "--rounds", "0", "--out", out, "--", "m", "{out}"], "--rounds")):
        p = _run(args, tmp_path)
        assert p.returncode != 0 and msg in p.stderr and "Traceback" not in p.stderr, (args, p.stderr[-1500:])


def test_arms_of_one_tree_differ_by_their_environment(tmp_path):
    """--env NAME:VAR=VALUE reaches that arm's runs only (a value may hold '=' and ':'); one tree twice is
    an A/B of the setting, compared as two trees are; the settings are in ab.md and on every row."""
    a = _tree(tmp_path, "a", 5.0)
    out = tmp_path / "out"
    p = _run([f"--arm=base={a}", f"--arm=shift={a}", "--env", "shift:AB_SHIFT=-1.5",
              "--env", "shift:AB_PROBE=--xla_flag=a:b", "--rounds", "2", "--out", str(out), "--group-by", "index",
              "--", "benchmarks.fake_bench", "--out", "{out}"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in open(out / "ab.jsonl")]
    assert {r["ab_arm"]: (r["probe"], r["ab_env"]) for r in rows} == {
        "base": (None, {}), "shift": ("--xla_flag=a:b", {"AB_SHIFT": "-1.5", "AB_PROBE": "--xla_flag=a:b"})}
    assert len({r["code"] for r in rows}) == 1
    md = open(out / "ab.md").read()
    assert "`AB_SHIFT=-1.5`, `AB_PROBE=--xla_flag=a:b`" in md
    line_a = next(x for x in md.splitlines() if x.startswith("| index=a |"))
    assert "shift vs base" in line_a and "lower step_ms (interval excludes 0)" in line_a, line_a
    assert abs(float(line_a.split("|")[5].split("[")[0]) + 1.5) < 0.02, line_a
    for env, msg in (("shift:AB_SHIFT", "NAME:VAR=VALUE"), ("AB_SHIFT=1", "NAME:VAR=VALUE"),
                     ("other:AB_SHIFT=1", "no arm 'other'"), ("shift:1X=1", "not an environment variable"),
                     ("shift:PYTHONPATH=/x", "PYTHONPATH"), ("shift:MTRAINING_COMMIT=abc", "tree's commit")):
        p = _run([f"--arm=base={a}", f"--arm=shift={a}", "--env", env, "--out", str(out), "--", "m", "{out}"],
                 tmp_path)
        assert p.returncode != 0 and msg in p.stderr and "Traceback" not in p.stderr, (env, p.stderr[-1500:])
    p = _run([f"--arm=x={a}", f"--arm=y={a}", "--env", "x:AB_SHIFT=1", "--env", "y:AB_SHIFT=1", "--out", str(out),
              "--", "m", "{out}"], tmp_path)
    assert p.returncode == 1 and "the same --env" in p.stderr, p.stderr[-1500:]


def test_round_order_rotates():
    assert [ab_trees.rounds_order(["a", "b", "c"], r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_a_run_past_the_timeout_stops_and_the_budget_skips_a_round_that_cannot_fit(tmp_path):
    """Device time: an arm that ran past --timeout would again, so the A/B stops (the rounds before are
    compared); with --budget a round starts only if the longest round so far fits; ab.md is written."""
    a, slow = _tree(tmp_path, "a", 1.0), _tree(tmp_path, "slow", 2.0, sleep=60.0)
    out = tmp_path / "out"
    p = _run([f"--arm=a={a}", f"--arm=slow={slow}", "--rounds", "3", "--timeout", "6", "--out", str(out), "--",
              "benchmarks.fake_bench", "--out", "{out}"], tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(os.listdir(out)) == ["ab.jsonl", "ab.md", "r00_a", "r00_slow"]  # no second round
    md = open(out / "ab.md").read()
    assert "Stopped in round 0: arm slow ran past --timeout 6 s" in md
    assert "no round with both arms: nothing compared" in md
    b = _tree(tmp_path, "b", 3.0, sleep=2.0)
    out2 = tmp_path / "out2"
    p = _run([f"--arm=a={a}", f"--arm=b={b}", "--rounds", "3", "--budget", "1", "--out", str(out2), "--",
              "benchmarks.fake_bench", "--out", "{out}"], tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(os.listdir(out2)) == ["ab.jsonl", "ab.md", "r00_a", "r00_b"]  # round 0 always runs
    md = open(out2 / "ab.md").read()
    assert "Stopped before round 1" in md and "--budget 1 s" in md and "one round: no interval" in md
    p = _run([f"--arm=a={a}", f"--arm=b={b}", "--budget", "-1", "--out", str(out2), "--", "m", "{out}"], tmp_path)
    assert p.returncode != 0 and "--budget >= 0" in p.stderr and "Traceback" not in p.stderr
