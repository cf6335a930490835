"""The CPU run's optional XLA flags (``tests/conftest.py``): a flag this jaxlib does not know would abort every
process that starts a JAX backend, so it is probed and left out, never passed on."""

import os

import conftest


def test_an_unknown_xla_flag_is_left_out_and_a_known_one_kept(monkeypatch):
    monkeypatch.setenv(conftest._PROBED_ENV, "")  # so that the environment's own value comes back afterwards
    monkeypatch.delenv(conftest._PROBED_ENV)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    known, unknown = "--xla_disable_hlo_passes=hlo-verifier", "--xla_no_such_flag_mtraining=true"
    assert conftest._supported_xla_flags((unknown, known)) == (known,)
    assert os.environ[conftest._PROBED_ENV] == known  # the verdict the workers and subprocesses read
    # read back from the environment, not probed again
    monkeypatch.setenv(conftest._PROBED_ENV, unknown)
    assert conftest._supported_xla_flags((unknown, known)) == (unknown,)


def test_the_run_compiles_with_the_flags_this_jaxlib_knows():
    flags = os.environ["XLA_FLAGS"].split()
    fast = os.environ.get("MTRAINING_TEST_FULL_OPT", "") in ("", "0")  # the switch that leaves them out
    assert ("--xla_backend_optimization_level=0" in flags) == fast
    probed = os.environ.get(conftest._PROBED_ENV, "").split()
    assert all(f in flags for f in probed) and (not fast or conftest._PROBED_ENV in os.environ)
