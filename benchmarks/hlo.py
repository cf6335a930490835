"""The one parser of optimized HLO text (``compiled.as_text()``) used by the benchmarks and tests.

An instruction line reads ``%name = SHAPE opcode(operands), attr=..., metadata={...}``; this module
turns such lines into :class:`Instruction` s and answers the questions the benchmarks ask of a
compiled step: how many instructions of each opcode (:func:`op_counts`), how many bytes each
collective-permute moves and between which devices (:func:`permutes`), which compute an asynchronous permute's
``-start`` / ``-done`` pair encloses (:func:`overlap_report`, :func:`schedule_outline`) and which
JAX op and source line emitted each instruction (:func:`hlo_sources`).
"""

from __future__ import annotations

import collections
import os
import re
from typing import NamedTuple

_DEF = re.compile(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$")
_OPCODE = re.compile(r"(?:^|[\s)}\]])([a-z][a-z\-]*)\(([^)]*)\)")
_ARRAY = re.compile(r"\b(pred|bf16|c64|c128|f8e\w+|[suf]\d+)\[([\d,]*)\]")
_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?metadata=\{([^}]*)\}", re.MULTILINE)
_META = re.compile(r'(op_name|source_file|source_line|stack_frame_id)=("(?:[^"\\]|\\.)*"|\d+)')
_COMPUTE = ("fusion", "custom-call", "dot", "convolution")
_OUTLINE = re.compile(r"collective-permute|all-reduce|all-gather|reduce-scatter|all-to-all|custom-call")

_TRITON = 'custom_call_target="__gpu$xla.gpu.triton"'
_TRITON_NAME = re.compile(r'"name":\s*"([^"]+)"')
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_ITEMSIZE = {"pred": 1, "bf16": 2, "c64": 8, "c128": 16}


class Instruction(NamedTuple):
    """One HLO instruction: ``name``, ``shape`` (the text before the opcode: an array shape such as
    ``bf16[2,1,64,2,8]{4,3,2,1,0}`` or a tuple of them), ``opcode``, ``operands`` (raw text) and
    the whole ``line``."""

    name: str
    shape: str
    opcode: str
    operands: str
    line: str


def instruction(line: str) -> Instruction | None:
    """The :class:`Instruction` of one HLO line, or ``None`` for any other line."""
    m = _DEF.match(line)
    op = _OPCODE.search(m.group(2)) if m else None
    if not op:
        return None
    return Instruction(m.group(1), m.group(2)[:op.start(1)].strip(), op.group(1), op.group(2), line)


def instructions(hlo_text: str) -> list[Instruction]:
    """Every instruction of the module, every computation (fusions, loop bodies) included."""
    return [ins for ins in map(instruction, hlo_text.splitlines()) if ins]


def entry(hlo_text: str) -> list[Instruction]:
    """The instructions of the ENTRY computation, in (scheduled) order."""
    body = hlo_text[hlo_text.find("\nENTRY"):]
    return instructions(body[:body.find("\n}")])


def array_bytes(shape: str) -> int:
    """Bytes of the FIRST array in an HLO shape (``bf16[2,3]{1,0}`` -> 12; for a tuple such as a
    ``collective-permute-start``'s ``(operand, output, u32[], u32[])``, the operand)."""
    m = _ARRAY.search(shape)
    if not m:
        raise ValueError(f"no array shape in {shape!r}")
    dtype, dims = m.groups()
    size = _ITEMSIZE.get(dtype) or (1 if dtype.startswith("f8") else max(1, int(dtype[1:]) // 8))
    for d in filter(None, dims.split(",")):
        size *= int(d)
    return size


def op_counts(hlo_text: str) -> collections.Counter:
    """Instructions per opcode over the whole module (every computation, loop bodies included):
    ``["collective-permute-start"]`` asynchronous permutes, ``["collective-permute"]`` synchronous
    ones. Counts opcodes only, not the names and operands that mention them."""
    return collections.Counter(ins.opcode for ins in instructions(hlo_text))


class Permute(NamedTuple):
    """One collective-permute: ``nbytes`` each device sends, ``pairs`` its ``(source, target)``
    device pairs."""

    nbytes: int
    pairs: frozenset


def permutes(hlo_text: str) -> list[Permute]:
    """Every collective-permute of the module (synchronous ``collective-permute`` or asynchronous
    ``-start``), in text order."""
    out = []
    for ins in instructions(hlo_text):
        if ins.opcode in ("collective-permute", "collective-permute-start"):
            m = _PAIRS.search(ins.line)
            pairs = frozenset((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))) if m else frozenset()
            out.append(Permute(array_bytes(ins.shape), pairs))
    return out


def overlap_report(hlo_text: str) -> list[tuple[str, int]]:
    """For each ``collective-permute-start`` of the ENTRY computation: ``(name, number of fusion /
    custom-call / dot / convolution instructions scheduled before its matching -done)``; a transfer
    with zero compute inside is exposed."""
    body = entry(hlo_text)
    starts: dict[str, int] = {}
    report = []
    for i, ins in enumerate(body):
        if ins.opcode == "collective-permute-start":
            starts[ins.name] = i
        elif ins.opcode == "collective-permute-done":
            src = ins.operands.strip().lstrip("%")
            if src in starts:
                s = starts.pop(src)
                report.append((src, sum(1 for x in body[s + 1:i] if x.opcode in _COMPUTE)))
    return report


def schedule_outline(hlo_text: str) -> list[str]:
    """The ENTRY computation of scheduled optimized HLO, reduced to its collectives and custom
    calls (Pallas kernels) in execution order: ``"name = op(operands) [kernel or op_name]"``.
    Shows which compute an asynchronous transfer's ``-start`` / ``-done`` pair encloses."""
    rows = []
    for name, _, opcode, operands, line in entry(hlo_text):
        if not _OUTLINE.search(opcode):
            continue
        label = re.search(r'"name":\s*"([^"]+)"', line) or re.search(r'op_name="([^"]+)"', line)
        operands = ",".join(o.strip().lstrip("%") for o in operands.split(","))[:80]
        rows.append(f"{name} = {opcode}({operands}) {label.group(1)[-70:] if label else ''}")
    return rows


def _table(hlo_text: str, header: str, row: str) -> dict[int, tuple]:
    """Rows of one of the HLO module's debug tables (``FileNames``, ``StackFrames``...)."""
    m = re.search(rf"^{header}\n((?:\d+ .*\n)+)", hlo_text, re.MULTILINE)
    rows = re.findall(rf"^(\d+) {row}$", m.group(1), re.MULTILINE) if m else []
    return {int(r[0]): r[1:] for r in rows}


def _frames(hlo_text: str):
    """``frame id -> "file:line < caller file:line < ..."`` from the module's stack-frame tables
    (newer XLA: ``metadata={... stack_frame_id=N}``; ``parent_frame_id`` is the parent's id + 1,
    so 1 means no parent)."""
    files = {i: os.path.basename(r[0]) for i, r in _table(hlo_text, "FileNames", r'"(.*)"').items()}
    locs = {i: (int(r[0]), int(r[2])) for i, r in _table(
        hlo_text, "FileLocations", r"\{file_name_id=(\d+) function_name_id=(\d+) line=(\d+).*\}").items()}
    frames = {i: (int(r[0]), int(r[1])) for i, r in _table(
        hlo_text, "StackFrames", r"\{file_location_id=(\d+) parent_frame_id=(\d+)\}").items()}

    def chain(fid: int, depth: int = 4) -> str:
        parts = []
        while fid in frames and len(parts) < depth:
            loc, parent = frames[fid]
            f, line = locs.get(loc, (0, 0))
            parts.append(f"{files.get(f, '?')}:{line}")
            fid = parent - 1
        return " < ".join(parts)
    return chain


def hlo_sources(hlo_text: str) -> dict[str, dict[str, str]]:
    """``{kernel name: {"op": jax op name, "src": "file:line < caller ..."}}`` from optimized HLO.

    A GPU kernel is named after its HLO instruction with ``.`` and ``-`` replaced by ``_``
    (``%input_scatter_fusion.3`` runs as ``input_scatter_fusion_3``), except a Pallas Triton kernel,
    which runs under its ``pallas_call``'s name (the custom call's ``backend_config`` ``name``): that
    name gets its instruction's entry with ``"pallas": True``. The instruction's
    ``metadata`` holds the JAX op name and the Python lines that emitted it (``source_file`` /
    ``source_line``, or a ``stack_frame_id`` into the module's frame tables)."""
    chain = _frames(hlo_text)
    out = {}
    for m in _HLO_INSTR.finditer(hlo_text):
        meta = {k: v.strip('"') for k, v in _META.findall(m.group(2))}
        if "op_name" not in meta:
            continue
        if "stack_frame_id" in meta:
            src = chain(int(meta["stack_frame_id"]))
        else:
            src = f"{os.path.basename(meta.get('source_file', '?'))}:{meta.get('source_line', '?')}"
        out[re.sub(r"[.\-]", "_", m.group(1))] = {"op": meta["op_name"][-160:], "src": src}
    for ins in instructions(hlo_text):  # a Triton kernel runs under its pallas_call's name, not the instruction's
        kernel = _TRITON_NAME.search(ins.line) if ins.opcode == "custom-call" and _TRITON in ins.line else None
        if kernel:
            hit = out.get(re.sub(r"[.\-]", "_", ins.name), {"op": "pallas_call", "src": "?"})
            out[kernel.group(1)] = {**hit, "pallas": True}
    return out
