"""Test setup: 8 virtual CPU devices (set before JAX is imported) and float64 available."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu") if os.environ.get("MTRAINING_TEST_GPU") is None else None

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
