"""``benchmarks/kernels.py --passes ... --loads-only`` (benchmarks/pass_floors.py): each Mosaic pass with
its tile math removed, to time the floor its loads set (results/kernels/kernels.md run 33). On the CPU:
the load-only kernels lower for CUDA without a single ``wgmma`` (the full ones have them), the kernels
are themselves again afterwards, the options reach ``passes`` and bad ones are refused up front, and
the floors table / plot read the rows right."""

import functools
import json
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import kernels
from benchmarks.pass_floors import floors, floors_table, loads_only, plot_floors
from pallas_kernels import mosaic_dkv, mosaic_dq, mosaic_fwd, mosaic_stream
from pallas_kernels.testing import lowering_inputs


def _lowered(name, **opts):
    """The four Mosaic passes lowered for CUDA at the lowering tests' shape: ``wgmma`` ops in the text
    (``opts``: the pass's own options)."""
    B, S, H, q, k, pos, idx = lowering_inputs(0)
    lse = jnp.zeros((B, H, S), jnp.float32)
    zk = jnp.zeros(k.shape, jnp.float32)
    kw = dict(sm_scale=0.1, block_size=64)
    fn, args = {"fwd": (mosaic_fwd.mosaic_fwd, (q, k, k, pos, pos, idx)),
                "dq": (mosaic_dq.mosaic_dq, (q, k, k, pos, pos, idx, q, lse, lse)),
                "dkv_blocks": (mosaic_dkv.mosaic_dkv_blocks, (q, k, k, pos, pos, idx, q, lse, lse)),
                "dkv_cols": (mosaic_dkv.mosaic_dkv_cols, (q, k, k, pos, pos, idx, q, lse, lse, zk, zk))}[name]
    text = jax.jit(functools.partial(fn, **kw, **opts)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("wgmma")


@pytest.mark.parametrize("name, opts", [("fwd", {}), ("dq", {}), ("dkv_blocks", {}), ("dkv_cols", {}),
                                        ("dkv_blocks", dict(stream="shared", walk="loops")),
                                        ("dkv_blocks", dict(stream="shared", walk="switch"))])
def test_loads_only_kernels_keep_no_math_and_restore(name, opts):
    saved = (mosaic_fwd.walk_stream, mosaic_dq.walk_stream, mosaic_dkv._dkv_consumer)
    with loads_only():
        assert _lowered(name, **opts) == 0
    assert (mosaic_fwd.walk_stream, mosaic_dq.walk_stream, mosaic_dkv._dkv_consumer) == saved
    assert mosaic_fwd.walk_stream is mosaic_stream.walk_stream
    assert _lowered(name, **opts) > 0  # the cleared caches: the kernel traced again, with its math


def test_loads_only_restores_after_an_error():
    saved = mosaic_dkv._dkv_consumer
    with pytest.raises(RuntimeError, match="boom"):
        with loads_only():
            raise RuntimeError("boom")
    assert mosaic_dkv._dkv_consumer is saved and mosaic_fwd.walk_stream is mosaic_stream.walk_stream


def test_pass_options_reach_passes_and_bad_ones_are_refused(monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(kernels, "passes", lambda *a, **k: seen.update(k) or [])
    argv = ["kernels.py", "--passes", "256", "--pass-names", "fwd", "--only-sweeps"]
    monkeypatch.setattr(sys, "argv", argv)
    kernels.main()
    assert (seen["slots"], seen["kv_step"], seen["impls"], seen["loads_only"], seen["rounds"],
            seen["dkv_streams"]) == ((None,), None, ("triton", "mosaic"), False, 1, (None,))
    monkeypatch.setattr(sys, "argv", argv + ["--slots", "2,5", "--kv-step", "64", "--pass-impls", "mosaic",
                                             "--loads-only", "--rounds", "3", "--dkv-streams",
                                             "default,split,shared:loops"])
    kernels.main()
    assert (seen["slots"], seen["kv_step"], seen["impls"], seen["loads_only"], seen["rounds"],
            seen["dkv_streams"]) == ((2, 5), 64, ("mosaic",), True, 3, (None, "split", "shared:loops"))
    for extra, msg in ((["--slots", "2,x"], "--slots: comma-separated integers, got '2,x'"),
                       (["--slots", "1"], "--slots: each >= 2, got '1'"),
                       (["--pass-impls", "cuda"], "--pass-impls: some of triton,mosaic, got 'cuda'"),
                       (["--rounds", "0"], "--rounds must be >= 1, got 0"),
                       (["--kv-step", "96"], "--kv-step: invalid choice: 96"),
                       (["--dkv-streams", "shared:zigzag"],
                        "--dkv-streams: 'shared:zigzag' is not STREAM or STREAM:WALK"),
                       (["--dkv-streams", "split:loops"], "--dkv-streams: 'split:loops' is not STREAM or STREAM:WALK"),
                       (["--dkv-streams", "index"], "--dkv-streams: 'index' is not STREAM or STREAM:WALK")):
        monkeypatch.setattr(sys, "argv", argv + extra)
        with pytest.raises(SystemExit):
            kernels.main()
        assert msg in capsys.readouterr().err
    # the comparison table (no --passes) takes a dK/dV stream per operator row, not a walk: refused up front
    monkeypatch.setattr(kernels, "run", lambda *a, **k: pytest.fail("timed a walk the table cannot apply"))
    monkeypatch.setattr(sys, "argv", ["kernels.py", "--seqs", "256", "--dkv-streams", "default,shared:loops"])
    with pytest.raises(SystemExit):
        kernels.main()
    assert "--dkv-streams: 'shared:loops' is not STREAM or STREAM:WALK" in capsys.readouterr().err


def _rows():
    rows = []
    for rnd, (f, lo) in enumerate([(10.0, 9.0), (12.0, 8.0), (11.0, 8.5)]):
        for p, scale in (("fwd", 1.0), ("dkv_blocks", 2.0)):
            base = dict(seq=131072, index="spread95", pass_=p, impl="mosaic", round=rnd, spread_ms=[0, 0])
            rows.append(dict(base, variant="full", ms=f * scale, tflops=400.0 / scale))
            rows.append(dict(base, variant="load_only", ms=lo * scale, tflops=1.0))
    rows.append(dict(seq=131072, index="spread95", pass_="fwd", impl="triton", variant="full", ms=13.0, round=0,
                     tflops=300.0, spread_ms=[0, 0]))  # no load-only row: not in the floors
    return rows


def test_floors_are_medians_over_rounds_and_their_ratio():
    got = floors(_rows())
    assert [(r["pass_"], r["impl"]) for r in got] == [("fwd", "mosaic"), ("dkv_blocks", "mosaic")]
    fwd, dkv = got
    assert (fwd["full_ms"], fwd["load_ms"]) == (11.0, 8.5) and fwd["ratio"] == pytest.approx(8.5 / 11.0)
    assert (dkv["full_ms"], dkv["load_ms"]) == (22.0, 17.0)
    assert fwd["flop"] == pytest.approx(400.0 * 11.0 * 1e9)  # TFLOP/s x ms of the full pass's median row
    table = floors_table(_rows())
    assert "| spread95 (128K) | fwd (mosaic) | 11.00 | 8.50 | 0.77 |" in table
    assert "| spread95 (128K) | dkv_blocks (mosaic) | 22.00 | 17.00 | 0.77 |" in table


def test_floors_plot_from_rows(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    out = tmp_path / "floors.png"
    plot_floors(_rows(), str(out))
    assert out.stat().st_size > 1000
    rows_file = tmp_path / "rows.jsonl"
    rows_file.write_text("".join(json.dumps(dict(r, run="x")) + "\n" for r in _rows()))
    out2 = tmp_path / "via_cli.png"
    monkeypatch.setattr(sys, "argv", ["kernels.py", "--plot-from", str(rows_file), "--runs", "x", "--plot", str(out2)])
    kernels.main()
    assert out2.stat().st_size > 1000
