"""Test setup: the platform, 8 virtual CPU devices (set before JAX is imported), float64 available.

Platform (decided in :func:`pytest_configure`, before any JAX backend starts):

* the default run (``-m 'not gpu'``, from ``pyproject.toml``) runs on the CPU
  (``JAX_PLATFORMS=cpu``, 8 virtual devices) on every machine;
* a run that selects the ``gpu``-marked tests (``python -m pytest -m gpu``) leaves the platform to
  JAX, i.e. the CUDA GPU where there is one. A ``gpu`` test with no GPU backend is SKIPPED with
  the reason (never run on the CPU in interpret mode and reported as passed), and the summary
  says so;
* an explicit ``JAX_PLATFORMS`` in the environment is always respected; ``MTRAINING_TEST_GPU=1``
  (older command) also leaves the platform to JAX for the default run.

The backend is started once at session start, so a test that asks for a different number of CPU
devices (e.g. the training CLI's ``mesh.cpu_devices``, which calls ``jax.config.update
("jax_num_cpu_devices", ...)``) can no longer change the device count of the tests after it;
JAX platform config and the environment it reads are restored after every test.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"  # host platform only: harmless on GPU

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_enable_x64", True)

# Property tests draw the same examples on every run (CI must not pass or fail by chance);
# HYPOTHESIS_PROFILE=explore draws new ones.
settings.register_profile("repro", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repro"))

_USER_PLATFORMS = os.environ.get("JAX_PLATFORMS")  # as the user started pytest
#: XLA flags of the CPU run (not of ``-m gpu``; ``MTRAINING_TEST_FULL_OPT=1`` leaves them out)
CPU_FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
#: ... and these where this jaxlib knows them (an XLA flag it does not know aborts the process, so each is
#: probed once, :func:`_supported_xla_flags`): fusions through XLA:CPU's elemental IR emitters instead of its
#: MLIR fusion emitters (the suite ~1.3x faster to compile on 2 cores, 2026-12-07), no HLO verifier between passes
CPU_FAST_COMPILE_FLAGS_IF_KNOWN = ("--xla_cpu_use_fusion_emitters=false", "--xla_disable_hlo_passes=hlo-verifier")
_PROBED_ENV = "MTRAINING_TEST_XLA_FLAGS_PROBED"  # the controller's verdict, inherited by workers and subprocesses
_GPU_STATE = {"selected": False, "skipped": 0, "reason": None}


def _selects_gpu_tests(config) -> bool:
    """Whether the ``-m`` expression selects tests marked ``gpu`` (``-m gpu``, ``-m "gpu or slow"``;
    not the default ``-m 'not gpu'``; an empty expression selects everything)."""
    expr = config.getoption("markexpr", "") or ""
    if not expr.strip():
        return True
    try:
        from _pytest.mark.expression import Expression

        return bool(Expression.compile(expr).evaluate(lambda name, **kw: name == "gpu"))
    except Exception:  # private API moved: a plain reading of the expression
        return "gpu" in expr and "not gpu" not in expr


#: the run's shared persistent compilation cache (see _shared_compilation_cache)
_CACHE_ENV = "MTRAINING_TEST_JAX_CACHE"
CACHE_MIN_COMPILE_SECS = 1.0


def _shared_compilation_cache(config) -> None:
    """One persistent compilation cache for the whole CPU run: the controller makes a temporary folder
    (removed at the end); the xdist workers and every subprocess a test starts (multi-process workers,
    CLI runs) find it through the environment. Programs that compiled for ``CACHE_MIN_COMPILE_SECS``
    or more are stored, so a program compiled again — by another test, another worker or another
    process — is loaded instead (the suite is compile-bound). ``MTRAINING_TEST_NO_CACHE=1`` turns it off."""
    if os.environ.get("MTRAINING_TEST_NO_CACHE", "") not in ("", "0"):
        return
    path = os.environ.get(_CACHE_ENV)
    if not path:
        import tempfile

        path = tempfile.mkdtemp(prefix="mtraining-test-jax-cache-")
        os.environ[_CACHE_ENV] = path
        config._mtraining_cache_owner = path
    os.environ.update(JAX_COMPILATION_CACHE_DIR=path,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=str(CACHE_MIN_COMPILE_SECS),
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _reset_cache()


def pytest_unconfigure(config):
    path = getattr(config, "_mtraining_cache_owner", None)
    if path:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


def _supported_xla_flags(flags) -> tuple:
    """Those of ``flags`` this jaxlib's XLA accepts: a CPU client started in a subprocess with all of them (and
    with each alone if that fails), once per run (the verdict reaches the workers and subprocesses through the
    environment, :data:`_PROBED_ENV`)."""
    if _PROBED_ENV in os.environ:
        return tuple(f for f in os.environ[_PROBED_ENV].split() if f in flags)
    import subprocess

    def known(flag):
        env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                              timeout=120).returncode == 0

    todo = tuple(f for f in flags if f.split("=")[0] not in os.environ["XLA_FLAGS"])
    ok = todo if todo and known(" ".join(todo)) else tuple(f for f in todo if len(todo) > 1 and known(f))
    os.environ[_PROBED_ENV] = " ".join(ok)
    return ok


def pytest_configure(config):
    gpu_run = _selects_gpu_tests(config)
    _GPU_STATE["selected"] = gpu_run
    legacy = os.environ.get("MTRAINING_TEST_GPU", "") not in ("", "0")
    if _USER_PLATFORMS is None and not gpu_run and not legacy:
        os.environ["JAX_PLATFORMS"] = "cpu"  # also for the subprocesses tests start
        jax.config.update("jax_platforms", "cpu")
    if not gpu_run and os.environ.get("MTRAINING_TEST_FULL_OPT", "") in ("", "0"):
        # The CPU suite is compile-bound (tiny arrays, large programs): LLVM at -O0 without its
        # expensive passes compiles ~1.6x faster. Set before the backend starts (XLA reads the
        # flags once, when the first client is made), and inherited by the subprocesses tests start.
        for flag in CPU_FAST_COMPILE_FLAGS + _supported_xla_flags(CPU_FAST_COMPILE_FLAGS_IF_KNOWN):
            if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
                os.environ["XLA_FLAGS"] += " " + flag
        _shared_compilation_cache(config)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow(seconds=N)`` (the longest, 25-90 s each on 2 CPU cores, N as measured in
    CI) run first, longest first: ``-n 2`` hands tests out in collection order, and a long one drawn
    last leaves the other worker idle to the end. The order is otherwise the collection order (the
    suite passes in any order, issue 35)."""
    def key(item):
        slow = item.get_closest_marker("slow")
        return 0.0 if slow is None else -float(slow.kwargs.get("seconds", 1))
    items.sort(key=key)
    shadowing = [p for p in sys.path if os.path.basename(os.path.normpath(p or ".")) == "benchmarks"]
    if shadowing:  # benchmarks/kernels.py would shadow the `kernels` package transformers imports
        raise pytest.UsageError(f"collecting the tests put a benchmarks folder on sys.path: {shadowing} (import "
                                f"benchmarks as `benchmarks.<name>` from the repository root)")


def _gpu_missing_reason():
    """``None`` when JAX has a CUDA GPU backend, else why not (starts the backends)."""
    if _GPU_STATE["reason"] is None:
        try:
            devs = jax.devices("gpu")
            _GPU_STATE["reason"] = "" if devs else "jax.devices('gpu') is empty"
        except RuntimeError:
            plats = ", ".join(sorted({d.platform for d in jax.devices()}))
            _GPU_STATE["reason"] = (f"JAX has no 'gpu' backend here (jax.devices(): {plats}; "
                                    f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r})")
    return _GPU_STATE["reason"] or None


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None:
        reason = _gpu_missing_reason()
        if reason:
            _GPU_STATE["skipped"] += 1
            pytest.skip(f"needs a CUDA GPU: {reason}")


def pytest_terminal_summary(terminalreporter):
    if _GPU_STATE["skipped"]:
        terminalreporter.write_sep("!", f"{_GPU_STATE['skipped']} GPU test(s) SKIPPED, NOT RUN: needs a CUDA GPU "
                                        f"({_GPU_STATE['reason']})", red=True, bold=True)


@pytest.fixture(scope="session", autouse=True)
def _jax_backend():
    """Start JAX's backends before the first test, with the platform and device count above."""
    jax.devices()
    yield


_RESTORED_CONFIG = ("jax_platforms", "jax_enable_x64", "jax_default_matmul_precision")
_RESTORED_ENV = ("JAX_PLATFORMS", "XLA_FLAGS")


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test module, drop JAX's in-process caches of traced and compiled programs: a CI worker runs
    hundreds of modules, and what they leave behind grows until XLA's compiler fails (two segfaults inside
    ``compile`` / the persistent cache's write, late in a worker's run). Programs shared across modules come
    back from the persistent compilation cache."""
    yield
    jax.clear_caches()


@pytest.fixture(autouse=True)
def _restore_jax_config():
    """Undo what a test (or the CLI it calls in process) changed in JAX's platform config, the
    environment JAX and subprocesses read, and ``sys.path``."""
    config = {k: getattr(jax.config, k) for k in _RESTORED_CONFIG}
    env = {k: os.environ.get(k) for k in _RESTORED_ENV}
    path = list(sys.path)
    yield
    sys.path[:] = path
    for k, v in config.items():
        if getattr(jax.config, k) != v:
            jax.config.update(k, v)
    for k, v in env.items():
        if os.environ.get(k) != v:
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def jax_compilation_cache(tmp_path_factory):
    """For modules whose training runs compile the same tiny train step several times: every program
    of the module goes to JAX's persistent compilation cache, however fast it compiled (the run's
    shared cache, or a folder of the module's own where that is off; restored afterwards). Use with
    ``pytestmark = pytest.mark.usefixtures("jax_compilation_cache")``."""
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    old = {k: getattr(jax.config, k) for k in keys}
    jax.config.update("jax_compilation_cache_dir", os.environ.get(_CACHE_ENV) or str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _reset_cache()  # JAX decides once per process whether the cache is on; make it look again
    yield
    for k, v in old.items():
        jax.config.update(k, v)
    _reset_cache()


def _reset_cache():
    try:  # private API; without it the cache is merely unused when another test compiled first
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    except (ImportError, AttributeError):
        pass


def pytest_runtest_logreport(report):
    """``MTRAINING_TEST_TIMES=<file>``: append ``when nodeid seconds`` per phase as tests finish (for
    finding what dominates the CI time, even from a run that was stopped)."""
    path = os.environ.get("MTRAINING_TEST_TIMES")
    if path and os.environ.get("PYTEST_XDIST_WORKER") is None:  # once: in the controller
        with open(path, "a") as f:
            f.write(f"{report.when}\t{report.nodeid}\t{report.duration:.2f}\n")


@pytest.fixture
def kernel_selections(monkeypatch):
    """The ``(direction, backend NAME)`` of every kernel the registry selects during the test."""
    from pallas_kernels import registry

    seen, select = [], registry.select

    def spy(impl, prob):
        mod = select(impl, prob)
        seen.append((prob.direction, mod.NAME))
        return mod

    monkeypatch.setattr(registry, "select", spy)
    return seen
