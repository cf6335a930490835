"""The one HLO parser of the benchmarks (benchmarks/hlo.py) on hand-written optimized HLO."""

from __future__ import annotations

import pytest

from benchmarks import hlo

SCHEDULED = """HloModule m

%fused (p: f32[2]) -> f32[2] {
  ROOT %c = f32[2]{0} collective-permute(%p), source_target_pairs={{0,1}}
}

ENTRY %main {
  %p.1 = f32[2]{0} parameter(0)
  %collective-permute-start = (f32[2]{0}, f32[2]{0}, u32[], u32[]) collective-permute-start(%p.1), metadata={op_name="a/ppermute"}
  %add.3 = f32[2]{0} add(%p.1, %p.1)
  %pallas_call.3 = (f32[4]{0}, f32[4]{0}) custom-call(%add.3, %p.1), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name": "block_sparse_fwd", "ir": "x"}
  %collective-permute-done = f32[2]{0} collective-permute-done(%collective-permute-start), metadata={op_name="a/ppermute"}
  %kv.2 = bf16[2,1,64,2,8]{4,3,2,1,0} parameter(1)
  %collective-permute-start.1 = (bf16[2,1,64,2,8]{4,3,2,1,0}, bf16[2,1,64,2,8]{4,3,2,1,0}, u32[], u32[]) collective-permute-start(%kv.2), channel_id=2, source_target_pairs={{0,1},{1,0}}
  ROOT %collective-permute-done.1 = bf16[2,1,64,2,8]{4,3,2,1,0} collective-permute-done(%collective-permute-start.1)
}
"""


def test_schedule_outline_keeps_collectives_and_kernels_in_order():
    assert hlo.schedule_outline(SCHEDULED)[:3] == [
        "collective-permute-start = collective-permute-start(p.1) a/ppermute",
        "pallas_call.3 = custom-call(add.3,p.1) block_sparse_fwd",
        "collective-permute-done = collective-permute-done(collective-permute-start) a/ppermute",
    ]


def test_a_triton_kernel_is_found_under_its_pallas_call_name():
    # the GPU runs %pallas_call.3 as a kernel named after its pallas_call (backend_config "name"), not
    # after the instruction; the trace summary counts it as a Pallas kernel from this entry
    got = hlo.hlo_sources(SCHEDULED.replace('backend_config={"name"',
                                            'metadata={op_name="jit(f)/pallas_call" source_file="/a/triton_kernels.py" '
                                            'source_line=169}, backend_config={"name"'))
    assert got["block_sparse_fwd"] == {"op": "jit(f)/pallas_call", "src": "triton_kernels.py:169", "pallas": True}
    assert got["pallas_call_3"] == {"op": "jit(f)/pallas_call", "src": "triton_kernels.py:169"}
    assert hlo.hlo_sources(SCHEDULED)["block_sparse_fwd"] == {"op": "pallas_call", "src": "?", "pallas": True}


def test_op_counts_count_opcodes_of_every_computation():
    # the fused computation's synchronous permute counts too; the names and operands that mention
    # "collective-permute-start" do not (the text says it 6 times, for 2 instructions)
    counts = hlo.op_counts(SCHEDULED)
    assert SCHEDULED.count("collective-permute-start") == 6
    assert (counts["collective-permute-start"], counts["collective-permute-done"], counts["collective-permute"]) == (2, 2, 1)
    assert (counts["custom-call"], counts["add"], counts["parameter"]) == (1, 1, 2)
    assert sum(counts.values()) == 9


def test_overlap_report_and_permutes():
    # the first async permute encloses the Pallas call (a custom-call; the add is not compute);
    # the second encloses nothing: exposed
    assert hlo.overlap_report(SCHEDULED) == [("collective-permute-start", 1), ("collective-permute-start.1", 0)]
    # text order: the fused sync permute (f32[2]), then the async ones (their operand, not the tuple)
    assert hlo.permutes(SCHEDULED) == [(8, {(0, 1)}), (8, frozenset()), (2 * 1 * 64 * 2 * 8 * 2, {(0, 1), (1, 0)})]


@pytest.mark.parametrize("shape, nbytes", [("bf16[2,3]{1,0}", 12), ("f32[]", 4), ("pred[5]", 5), ("s8[4]", 4),
                                            ("f8e4m3fn[3]", 3), ("(f64[2]{0}, u32[])", 16), ("c64[2]", 16)])
def test_array_bytes(shape, nbytes):
    assert hlo.array_bytes(shape) == nbytes


def test_array_bytes_names_a_shape_without_array():
    with pytest.raises(ValueError, match="token"):
        hlo.array_bytes("token[]")


def test_hlo_sources_resolve_stack_frames():
    text = """HloModule m

FileNames
1 "/x/ring.py"
2 "/x/model.py"

FunctionNames
1 "f"
2 "g"

FileLocations
1 {file_name_id=1 function_name_id=1 line=42 end_line=42 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=7 end_line=7 column=1 end_column=2}

StackFrames
1 {file_location_id=2 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=2}

ENTRY %main {
  %input_scatter_fusion.3 = f32[2]{0} fusion(%p), kind=kInput, metadata={op_name="jit(f)/scatter-add" stack_frame_id=2}
}
"""
    assert hlo.hlo_sources(text)["input_scatter_fusion_3"] == {"op": "jit(f)/scatter-add", "src": "ring.py:42 < model.py:7"}
