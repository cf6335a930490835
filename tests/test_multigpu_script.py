"""benchmarks/multigpu.sh keeps what a device call can bring back: however a phase ends (done, or cut by
its timeout clamped to ``DEADLINE_S``), the bulky per-case artefacts (HLO text, traces, schedules) are
removed and the row files stay, and the script ends before the deadline. A device call returns at most
8 files; a phase cut by an outer timeout once left 13 behind and its rows were the ones dropped. The
benchmark is replaced by a stand-in ``python`` that writes what ``sparse_ring.py`` writes, then sleeps."""

import os
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAKE = """#!/bin/bash
out=$(echo "$*" | sed -n 's/.*--out \\([^ ]*\\).*/\\1/p')
mkdir -p "$out/profile_case/plugins"
echo '{"row": 1}' > "$out/sparse_ring.jsonl"
echo hlo > "$out/case.hlo.txt"
echo schedule > "$out/schedule_case.txt"
sleep "${FAKE_SLEEP:-0}"
"""


def _run(tmp_path, sleep: int, deadline: int):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").write_text(FAKE)
    (bindir / "python").chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", FAKE_SLEEP=str(sleep), DEADLINE_S=str(deadline))
    out = tmp_path / "out"
    t0 = time.time()
    p = subprocess.run(["bash", str(REPO / "benchmarks" / "multigpu.sh"), str(out), "weak"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    return p, sorted(str(f.relative_to(out)) for f in out.rglob("*")), time.time() - t0


@pytest.mark.parametrize("sleep,deadline", [(0, 0), (30, 13)], ids=["phase-ends", "deadline-cuts-the-phase"])
def test_rows_stay_and_bulky_artefacts_go(tmp_path, sleep, deadline):
    p, files, took = _run(tmp_path, sleep, deadline)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "=== done" in p.stdout, p.stdout
    assert files == ["weak", "weak/sparse_ring.jsonl"], files
    if deadline:  # the phase's 400 s timeout clamped to 13 - 10 = 3 s: the script ends long before the sleep
        assert took < deadline, took
