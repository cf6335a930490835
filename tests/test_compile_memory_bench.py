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
