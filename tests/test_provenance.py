"""Results rows name the code they ran: ``benchmarks._driver.provenance``'s commit carries ``+dirty``
when tracked files differ from HEAD (a device run of uncommitted code must not claim the commit)."""

import os
import shutil
import subprocess

import pytest

from benchmarks import _driver


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_provenance_marks_a_dirty_tree(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    (repo / "benchmarks" / "code.py").write_text("x = 1\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "c"]):
        subprocess.run(["git", *cmd], cwd=repo, check=True, env=env)
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True,
                          text=True, check=True).stdout.strip()
    monkeypatch.delenv("MTRAINING_COMMIT", raising=False)
    monkeypatch.setattr(_driver, "__file__", str(repo / "benchmarks" / "_driver.py"))
    assert _driver.provenance([])["commit"] == head
    (repo / "untracked.txt").write_text("ignored by the check\n")
    assert _driver.provenance([])["commit"] == head
    (repo / "benchmarks" / "code.py").write_text("x = 2\n")
    assert _driver.provenance(["--flag"])["commit"] == head + "+dirty"
    monkeypatch.setenv("MTRAINING_COMMIT", "abc123")
    assert _driver.provenance([])["commit"] == "abc123"
