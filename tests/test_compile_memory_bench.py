"""benchmarks/compile_memory.py: the buffer-assignment reader and its arguments (the measurement
itself compiles a 128K training step: run on the GPU, rows in results/training/)."""

import pytest

from benchmarks import compile_memory

BA = """BufferAssignment:
allocation 0: size 1024, parameter 0, shape |f32[256]| at ShapeIndex {}:
 value: <0 p0 @0> (size=1024,offset=0): f32[256]{0}
allocation 1: size 5000, page 0, preallocated-temp:
 value: <3 fusion.1 @0> (size=4096,offset=0): bf16[2048]{0}
 value: <4 fusion.2 @0> (size=4096,offset=0): bf16[2048]{0}
 value: <5 custom-call.7{0} @0> (size=512,offset=4096): f32[128]{0}
 value: <6 copy.3 @0> (size=64,offset=4608): s32[16]{0}
allocation 2: size 8, constant:
 value: <9 c @0> (size=8,offset=0): f32[2]{0}
"""


def test_temp_values_lists_the_temp_allocation_largest_first(tmp_path):
    path = tmp_path / "m.buffer-assignment.txt"
    path.write_text(BA)
    got = compile_memory.temp_values(str(path), 2)
    # one row per (offset, size) slot: the two 4 KiB values share offset 0 (never live together)
    assert got == [(4096, 0, "fusion.1", "bf16[2048]{0}"), (512, 4096, "custom-call.7{0}", "f32[128]{0}")]


def test_unknown_variant_is_refused_up_front():
    with pytest.raises(SystemExit, match="unknown variants \\['mt-fast'\\]"):
        compile_memory.main(["--variants", "mt,mt-fast"])


def test_mosaic_calls_counts_kernel_launches_not_mentions():
    # the serialized kernel modules and their helpers mention mosaic_gpu too: only launches count
    text = ('%1:2 = stablehlo.custom_call @mosaic_gpu_v2(%0, %a) {module = "mosaic_gpu_init_tma_desc"}\n'
            '%2 = stablehlo.custom_call @cudnn$fmha(%1)\n'
            '%3:2 = stablehlo.custom_call @mosaic_gpu_v2(%1#0) {module = "mosaic_gpu.smem mosaic_gpu_smem_alloc"}\n')
    assert compile_memory.mosaic_calls(text) == 2
    assert compile_memory.mosaic_calls("no kernels here: mosaic_gpu") == 0


def test_output_residual_variants_patch_what_the_ring_saves(monkeypatch):
    # the patches the mt-int2 / mt-bf16out variants apply (in their own process) change what the ring saves
    import jax.numpy as jnp

    from mtraining_jax.ring import attention
    from pallas_kernels import api

    monkeypatch.setattr(api, "LO_DTYPE", api.LO_DTYPE)
    monkeypatch.setattr(attention, "split_output", attention.split_output)
    monkeypatch.setattr(api, "split_output", api.split_output)
    out = jnp.linspace(-3.0, 3.0, 64, dtype=jnp.float32).reshape(1, 4, 2, 8) / 7.0
    compile_memory._patch_output_residual("mt")
    assert attention.split_output(out, jnp.bfloat16)[1].dtype == jnp.int4
    compile_memory._patch_output_residual("mt-int2")
    hi, lo = attention.split_output(out, jnp.bfloat16)
    assert lo.dtype == jnp.int2
    # int2 codes still halve the rounded output's error (half-ulp steps: at most a quarter ulp left)
    err_hi = jnp.abs(api.output_f32(hi) - out).max()
    err_lo = jnp.abs(api.output_f32(hi, lo) - out).max()
    assert 0 < err_lo <= 0.5 * err_hi + 1e-9
    compile_memory._patch_output_residual("mt-bf16out")
    hi, lo = attention.split_output(out, jnp.bfloat16)
    assert lo is None and hi.dtype == jnp.bfloat16
    assert api.split_output(out, jnp.bfloat16)[1] is None  # the single-device op's too



def test_flat_repeats_patch_runs_each_repeat_as_its_own_scans(monkeypatch):
    """``mt-flatrepeats``: a dense layer every third layer (a pattern repeated twice) as four separate runs gives
    the nested scan's loss and gradients; no repeated block reaches the scans."""
    import chex
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from mtraining_jax.model import qwen2
    from mtraining_jax.model.config import ModelConfig

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                      num_layers=6, dense_layers=(0, 3), attention_backend="reference", dense_backend="cudnn",
                      dtype="float32", param_dtype="float32")
    graphdef, state = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    t, pos = jnp.asarray(np.random.RandomState(0).randint(0, 64, (1, 16)), jnp.int32), jnp.arange(16, dtype=jnp.int32)
    f = jax.value_and_grad(lambda st: nnx.merge(graphdef, st)(t, pos).astype(jnp.float32).std())
    want = f(state)
    seen = []
    monkeypatch.setattr(qwen2, "_scan_blocks", lambda x, s, blocks, fns, inner=qwen2._scan_blocks: (
        seen.append(blocks), inner(x, s, blocks, fns))[1])
    compile_memory._patch_flat_repeats()
    chex.assert_trees_all_close(f(state), want, atol=1e-6, rtol=1e-5)
    assert [b[:2] for b in seen[-1]] == [(0, 1), (3, 1)] and all(len(b[2]) == 2 for b in seen[-1])
