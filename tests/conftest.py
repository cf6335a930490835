"""Test setup: 8 virtual CPU devices (set before JAX is imported) and float64 available."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu") if os.environ.get("MTRAINING_TEST_GPU") is None else None

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_enable_x64", True)

# Property tests draw the same examples on every run (CI must not pass or fail by chance);
# HYPOTHESIS_PROFILE=explore draws new ones.
settings.register_profile("repro", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repro"))


@pytest.fixture(scope="module")
def jax_compilation_cache(tmp_path_factory):
    """For modules whose training runs compile the same tiny train step several times: share it
    through JAX's persistent compilation cache (restored afterwards). Use with
    ``pytestmark = pytest.mark.usefixtures("jax_compilation_cache")``."""
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    old = {k: getattr(jax.config, k) for k in keys}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
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
