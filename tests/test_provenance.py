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


def test_rows_name_the_code_they_imported(tmp_path, monkeypatch):
    """``code`` is a digest of the imported tree's sources (a one-byte change moves it); a PYTHONPATH
    naming another tree than the one imported (``python -m`` from another checkout) raises up front."""
    root = _driver.code_root()
    assert os.path.isfile(os.path.join(root, "mtraining_jax", "__init__.py"))
    digest = _driver.code_digest(root)
    assert len(digest) == 12 and int(digest, 16) >= 0
    copy = tmp_path / "tree"
    for pkg in _driver.CODE_PACKAGES:
        shutil.copytree(os.path.join(root, pkg), copy / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "README.md").write_text("not code\n")
    assert _driver.code_digest(str(copy)) == digest
    f = copy / "pallas_kernels" / "mosaic_dkv.py"
    f.write_text(f.read_text().replace("stages", "stagez", 1))
    assert _driver.code_digest(str(copy)) != digest
    # PYTHONPATH: its first tree with mtraining_jax must be the imported one
    assert _driver.check_code_source({"PYTHONPATH": root}) == root
    assert _driver.check_code_source({"PYTHONPATH": os.pathsep.join([str(tmp_path / "none"), root])}) == root
    assert _driver.check_code_source({}) == root
    with pytest.raises(RuntimeError, match=f"PYTHONPATH names '{copy}' for mtraining_jax, but this process "
                                           f"imported it from '{root}'"):
        _driver.check_code_source({"PYTHONPATH": os.pathsep.join([str(copy), root])})
    monkeypatch.setenv("PYTHONPATH", str(copy))
    with pytest.raises(RuntimeError, match="run the command from inside"):
        _driver.provenance([])
    monkeypatch.setenv("PYTHONPATH", root)
    assert _driver.provenance([])["code"] == digest


def test_python_m_from_another_checkout_is_refused(tmp_path):
    """The failure it guards against, end to end: ``PYTHONPATH=<copy> python -m benchmarks.train_throughput``
    from this checkout exits with the error before running anything; from inside the copy it would run
    the copy's code."""
    import sys

    root = _driver.code_root()
    copy = tmp_path / "tree"
    for pkg in _driver.CODE_PACKAGES:
        shutil.copytree(os.path.join(root, pkg), copy / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(root, "configs"), copy / "configs")
    cmd = [sys.executable, "-m", "benchmarks.train_throughput", "--config", "configs/tiny_cpu.yaml", "--seq-lens", "64",
           "--backends", "reference", "--steps", "1", "--warmup", "0"]
    env = {**os.environ, "PYTHONPATH": str(copy), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "run the command from inside" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    probe = [sys.executable, "-c", "from benchmarks import _driver; print(_driver.code_root())"]
    out = subprocess.run(probe, cwd=copy, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == str(copy), out.stderr[-2000:]
