"""The kernel registry: impl names validated once, per-backend ``supports``, ``auto`` fall-through."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from pallas_kernels import api, registry
from pallas_kernels.registry import Problem

HOPPER = Problem("fwd", "bfloat16", 128, 64, 8192, 8192, "gpu", "9.0")


@pytest.mark.parametrize("bad", ["cuda", "", None, 3, "Mosaic", True])
def test_unknown_impl_named(bad):
    with pytest.raises(ValueError, match="unknown impl"):
        registry.validate_impl(bad)


@pytest.mark.parametrize("bad", ["fast", "", None, 1, "Shared"])
def test_unknown_kernel_stream_named_up_front(bad):
    """The Mosaic kernels' stream is checked where every caller enters (the api), also when the
    backend that runs ignores it (the XLA twin here)."""
    with pytest.raises(ValueError, match="unknown kernel stream"):
        registry.validate_stream(bad)
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    pos = jnp.arange(128)
    with pytest.raises(ValueError, match=f"unknown kernel stream {bad!r}"):
        api.block_sparse_attention_fwd(q, q, q, pos, pos, impl="xla", stream=bad)
    out, lse = api.block_sparse_attention_fwd(q, q, q, pos, pos, impl="xla", stream="shared")
    assert out.shape == (1, 128, 2, 64) and lse.shape == (1, 2, 128)


def test_alias_and_names():
    assert registry.validate_impl("pallas") == "triton"
    assert set(registry.BACKENDS) == {"mosaic", "triton", "xla"}
    for name in registry.BACKENDS:
        assert registry.module(name).NAME == name


def test_auto_on_hopper_prefers_mosaic_in_both_directions():
    assert registry.select("auto", HOPPER).NAME == "mosaic"
    assert registry.select("auto", dataclasses.replace(HOPPER, direction="bwd")).NAME == "mosaic"
    # float32 gradients: Mosaic declines, auto falls through to Triton
    assert registry.select("auto", dataclasses.replace(HOPPER, direction="bwd", dtype="float32")).NAME == "triton"


@pytest.mark.parametrize("change, reason", [
    (dict(dtype="float32"), "dtype float32"),
    (dict(head_dim=256), "head_dim 256"),
    (dict(block_size=32), "block_size 32"),
    (dict(sq=192), "multiple of 128"),
    (dict(compute_capability="8.0"), "Hopper"),
    (dict(platform="cpu", compute_capability=None), "Hopper"),
])
def test_mosaic_declares_what_it_cannot_run(change, reason):
    prob = dataclasses.replace(HOPPER, **change)
    with pytest.raises(NotImplementedError, match=reason):
        registry.select("mosaic", prob)
    want = "xla" if prob.platform == "cpu" else "triton"
    assert registry.select("auto", prob).NAME == want  # auto falls through


def test_auto_on_cpu_is_the_twin():
    assert registry.select("auto", dataclasses.replace(HOPPER, platform="cpu", compute_capability=None)).NAME == "xla"


def test_named_mosaic_off_gpu_raises_through_api():
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    pos = jnp.arange(128, dtype=jnp.int32)
    with pytest.raises(NotImplementedError, match="mosaic"):
        api.block_sparse_attention_fwd(q, q, q, pos, pos, None, impl="mosaic")


def test_configs_validate_against_the_registry():
    from mtraining_jax.attention.mtraining import MTrainingConfig
    from mtraining_jax.model.config import ModelConfig
    from mtraining_jax.ring.config import RingOptions

    with pytest.raises(ValueError, match="unknown impl 'cuda'"):
        MTrainingConfig(ring=RingOptions(impl="cuda"))
    MTrainingConfig(ring=RingOptions(impl="mosaic"))
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert "attention_impl" in fields
    assert set(registry.IMPLS) >= {"auto", "mosaic", "triton", "xla", "pallas"}
