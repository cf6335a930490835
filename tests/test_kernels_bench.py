"""The kernel benchmark's dense ring-step comparison (issue 33 item 3): both kinds of ring step, our
kernel and the cuDNN stand-in, real timings and FLOP counts, speed-ups relative to the same run's cuDNN."""

import pytest

from benchmarks.kernels import ring_step


def test_ring_step_rows():
    rows = ring_step(128, 4, 2, 32, reps=1, impls=("xla",))
    assert [(r["step"], r["name"]) for r in rows] == [("visible", "cudnn"), ("visible", "xla"),
                                                        ("diagonal", "cudnn"), ("diagonal", "xla")]
    for r in rows:
        assert r["table"] == "ring_step" and (r["seq"], r["heads"], r["kv_heads"], r["head_dim"]) == (128, 4, 2, 32)
        assert r["fwd_ms"] > 0 and r["fb_ms"] > 0 and r["fwd_tflops"] > 0
        assert {"commit", "date", "device", "jax", "command"} <= set(r)
    by = {(r["step"], r["name"]): r for r in rows}
    for step in ("visible", "diagonal"):
        assert by[(step, "cudnn")]["x_cudnn_fb"] == 1.0 and by[(step, "cudnn")]["impl"].startswith("xla")
        assert by[(step, "xla")]["x_cudnn_fb"] == pytest.approx(by[(step, "cudnn")]["fb_ms"] / by[(step, "xla")]["fb_ms"])
        assert by[(step, "xla")]["impl"] == "xla"
    # a visible step computes every pair, a diagonal one the causal half (plus the diagonal)
    vis, diag = by[("visible", "xla")], by[("diagonal", "xla")]
    assert vis["fwd_tflops"] * vis["fwd_ms"] / (diag["fwd_tflops"] * diag["fwd_ms"]) == pytest.approx(128 * 128 / (128 * 129 / 2))


def test_passes_shape_option(capsys):
    """``--shape HQ,HKV,D`` (the training step's 14,2,64): parsed and checked up front; the inputs and
    the family indices take it."""
    import argparse

    import numpy as np

    from benchmarks.kernel_cases import family_index, inputs
    from benchmarks.kernels import _parse_shape

    ap = argparse.ArgumentParser()
    assert _parse_shape("14,2,64", ap) == (14, 2, 64)
    for bad, msg in (("14,2", "three integers"), ("14,x,64", "three integers"), ("14,3,64", "HKV dividing HQ"),
                     ("16,2,96", "D in"), ("0,2,64", "HKV dividing HQ")):
        with pytest.raises(SystemExit):
            _parse_shape(bad, ap)
        err = capsys.readouterr().err
        assert msg in err and repr(bad) in err, err
    q, k, v, do = inputs(256, 0, np.float32, (14, 2, 64))
    assert q.shape == do.shape == (1, 256, 14, 64) and k.shape == v.shape == (1, 256, 2, 64)
    idx, name = family_index(np.random.default_rng(0), "band", 1024, 0.9, 64, heads=14)
    assert idx.block_count.shape[:2] == (1, 14) and name == "band90"


def test_sweep_json_rows_carry_provenance(tmp_path, monkeypatch):
    """``--passes ... --json out.json`` writes ``out_sweep.json`` whose every row names its commit, code,
    date, device, JAX version and command (run 25's pass rows came back without them)."""
    import json
    import sys

    from benchmarks import kernels

    rows = [{"seq": 256, "index": "band90", "pass_": "dkv_cols", "impl": "mosaic", "ms": 1.0}]
    monkeypatch.setattr(kernels, "passes", lambda *a, **k: [dict(r) for r in rows])
    monkeypatch.setattr(kernels, "passes_table", lambda r: "table")
    out = tmp_path / "cols.json"
    monkeypatch.setattr(sys, "argv", ["kernels.py", "--passes", "256", "--families", "band", "--pass-names",
                                      "dkv_cols", "--only-sweeps", "--reps", "1", "--json", str(out)])
    kernels.main()
    got = json.loads((tmp_path / "cols_sweep.json").read_text())
    assert [r["index"] for r in got] == ["band90"] and got[0]["ms"] == 1.0
    assert {"commit", "code", "date", "device", "jax", "command"} <= set(got[0])
    assert "--passes 256" in got[0]["command"]


def test_col_walks_option(tmp_path, monkeypatch, capsys):
    """``--col-walks`` reaches :func:`passes` in order with repeats (an A/B both ways round in one
    process); an unknown walk is refused up front, naming it and the known ones."""
    import sys

    from benchmarks import kernels

    seen = {}
    monkeypatch.setattr(kernels, "passes", lambda *a, **k: seen.update(k) or [])
    argv = ["kernels.py", "--passes", "256", "--pass-names", "dkv_cols", "--only-sweeps"]
    monkeypatch.setattr(sys, "argv", argv)
    kernels.main()
    assert seen["col_walks"] is None  # passes() then times the operator's walk, DEFAULT_COL_WALK
    monkeypatch.setattr(sys, "argv", argv + ["--col-walks", "masked,free,free,masked"])
    kernels.main()
    assert seen["col_walks"] == ("masked", "free", "free", "masked")
    monkeypatch.setattr(sys, "argv", argv + ["--col-walks", "masked,loose"])
    with pytest.raises(SystemExit):
        kernels.main()
    err = capsys.readouterr().err
    assert "--col-walks: 'loose' is not STREAM or STREAM:WALK" in err and "'masked', 'free'" in err, err
    monkeypatch.setattr(sys, "argv", argv + ["--col-walks", "free,shared:switch,shared:loops"])
    kernels.main()
    assert seen["col_walks"] == ("free", "shared:switch", "shared:loops")
    for bad in ("free:loops", "shared:zigzag"):  # a walk only for the shared stream, and one of WALKS
        monkeypatch.setattr(sys, "argv", argv + ["--col-walks", bad])
        with pytest.raises(SystemExit):
            kernels.main()
        err = capsys.readouterr().err
        assert f"--col-walks: '{bad}' is not STREAM or STREAM:WALK" in err, err
        assert "(a walk only for ('shared',))" in err, err


def test_default_col_walk_is_the_operators():
    """The column pass's default walk is defined once (``mosaic_dkv.DEFAULT_COL_WALK``, one of
    ``COL_WALKS``) and is what ``mosaic_dkv_cols`` (the operator's column pass) runs when not told."""
    import inspect

    from pallas_kernels import mosaic_dkv

    assert mosaic_dkv.DEFAULT_COL_WALK in mosaic_dkv.COL_WALKS
    sig = inspect.signature(mosaic_dkv.mosaic_dkv_cols)  # through jax.jit's __wrapped__
    assert sig.parameters["col_walk"].default == mosaic_dkv.DEFAULT_COL_WALK == "free"


def test_operator_rows_take_positions_and_index_as_arguments(monkeypatch):
    """The comparison table times ``block_sparse_attention`` with the positions and the index as arguments of
    the jitted call, as training does: closed over, they were constants and XLA folded part of the index's
    operand build into the program (runs up to 33: the benchmark's log showed the dK/dV schedule being
    constant-folded), so the timed call left that work out. The full causal index is the API's own
    (``index=None``)."""
    from benchmarks import kernels
    from pallas_kernels.index_format import StepIndex

    seen = {}
    real = kernels.timeit

    def spy(fn, *args, **kw):
        seen.setdefault(len(seen), args)
        return real(fn, *args, **kw)

    monkeypatch.setattr(kernels, "timeit", spy)
    rows = kernels.run([256], [0.9], 0, 256, 1, impls=("xla",), families=("band",))
    assert [r["name"] for r in rows] == ["cudnn", "xla_full", "xla_band90"]
    calls = list(seen.values())  # fwd and fwd+bwd per row
    assert len(calls) == 6
    assert all(len(a) == 3 for a in calls[0:1]) and len(calls[1]) == 4  # cuDNN: q, k, v (+ ct)
    full_fwd, full_fb, band_fwd, band_fb = calls[2:]
    assert len(full_fwd) == 4 and full_fwd[3].shape == (256,) and len(full_fb) == 5  # positions, no index
    assert isinstance(band_fwd[4], StepIndex) and isinstance(band_fb[5], StepIndex)
    assert all(r["fwd_ms"] > 0 and r["fb_ms"] > 0 for r in rows)
    assert rows[0]["x_cudnn"] == 1.0 and rows[2]["x_cudnn"] == rows[0]["fb_ms"] / rows[2]["fb_ms"]


def test_dkv_stream_reaches_a_pass_traced_before():
    """``dkv_stream(s)`` (the comparison table's ``auto[dkv=s]`` rows): the dK/dV block pass traced inside
    walks stream ``s`` even where the same call was traced outside first (the jitted pass's trace is keyed
    on ``stream="auto"``: without clearing JAX's caches the outer trace was reused, and run 34's first
    ``auto[dkv=shared]`` rows timed the split stream), and after the context the default again."""
    import jax

    from benchmarks.kernels import dkv_stream
    from pallas_kernels.mosaic_dkv import mosaic_dkv_blocks
    from pallas_kernels.testing import lowering_inputs

    B, S, H, q, k, pos, idx = lowering_inputs(4)
    lse = jax.numpy.zeros((B, H, S), jax.numpy.float32)

    def program(**kw):  # a fresh outer jit each time, as each timed row is
        f = jax.jit(lambda q, k, idx, lse: mosaic_dkv_blocks(q, k, k, pos, pos, idx, q, lse, lse, sm_scale=0.1,
                                                              **kw))
        return str(f.trace(q, k, idx, lse).jaxpr)

    default, shared = program(), program(stream="shared")
    assert default == program(stream="split") != shared
    with dkv_stream("shared"):
        assert program() == shared
    assert program() == default
    with dkv_stream(None):
        assert program() == default
    with pytest.raises(ValueError, match="the dK/dV block pass's stream must be one of .* got 'index'"):
        with dkv_stream("index"):
            pass


def test_family_plot_takes_the_median_of_rounds(tmp_path, monkeypatch):
    """``plot_families`` on two rounds of one case: the bars are the rounds' medians and the whiskers span every
    row's fastest to slowest repeat (the Mosaic / Triton ratio paired per round)."""
    from benchmarks import kernels_report

    def row(name, rnd, fb, spread, tflops):
        return dict(name=name, family="band" if name != "cudnn" else "dense", density=0.05, seq=131072, round=rnd,
                    fb_ms=fb, fb_spread_ms=spread, fb_tflops=tflops, table="families")

    rows = [row("cudnn", 1, 470.0, [460.0, 480.0], 520.0),
            row("triton_band95", 1, 36.0, [35.0, 37.0], 330.0), row("auto_band95", 1, 30.0, [29.0, 33.0], 400.0),
            row("triton_band95", 2, 36.0, [36.0, 36.0], 330.0), row("auto_band95", 2, 28.0, [28.0, 28.0], 420.0)]
    bars = {}

    class Ax:
        def __init__(self, name):
            self.name = name

        def bar(self, x, heights, **kw):
            bars.setdefault(self.name, []).append((list(heights), kw.get("yerr")))

        def __getattr__(self, _):
            return lambda *a, **k: None

    class Plt:
        def subplots(self, *a, **k):
            return None, (Ax("tflops"), Ax("ratio"))

    monkeypatch.setattr(kernels_report, "_pyplot", lambda: Plt())
    monkeypatch.setattr(kernels_report, "_save", lambda *a, **k: None)
    kernels_report.plot_families(rows, str(tmp_path / "f.png"))
    (tri, tri_err), (mos, mos_err) = bars["tflops"]
    assert tri == [330.0] and mos == [pytest.approx(410.0)]
    assert mos_err[0][0] == pytest.approx(410 - 400 * 30 / 33) and mos_err[1][0] == pytest.approx(420 - 410)
    (ratio, ratio_err), = bars["ratio"]
    assert ratio == [pytest.approx((36 / 30 + 36 / 28) / 2)]
    assert ratio_err[1][0] == pytest.approx(36 / 28 - ratio[0])


def test_pass_plot_labels_tell_walks_floors_and_builds_apart(tmp_path, monkeypatch):
    """A pass row's bar label (``plot_passes``): impl, column walk, ``--loads-only`` floor and an A/B's
    ``build`` (results run 38: two commits' kernels, one process each) each end up in it, and a plot of
    such rows is written."""
    import json
    import sys

    from benchmarks.kernels import main
    from benchmarks.kernels_report import _pass_label

    base = {"seq": 131072, "index": "vert95", "pass_": "dkv_cols", "impl": "mosaic", "ms": 8.4,
            "spread_ms": [8.3, 8.5], "tflops": 520.0}
    assert _pass_label(dict(base, impl="triton")) == "triton"
    assert _pass_label(dict(base, col_walk="free")) == "mosaic, free walk"
    assert _pass_label(dict(base, col_walk="free", variant="load_only")) == "mosaic, free walk, loads only"
    assert _pass_label(dict(base, col_walk="free", build="one info copy (804cfc3)")) == \
        "mosaic, free walk, one info copy (804cfc3)"
    rows = [dict(base, col_walk="free", build=b, run="ab") for b in ("new", "old")]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ab.png"
    monkeypatch.setattr(sys, "argv", ["kernels.py", "--plot-from", str(src), "--runs", "ab", "--plot", str(out)])
    main()
    assert out.stat().st_size > 10_000


def test_fwd_bwd_takes_a_bf16_do_and_times_nothing_else():
    """The fwd+bwd rows (``benchmarks.kernel_cases.fwd_bwd``): ``"do"`` is the backward at a given bf16 ``dO``, as a
    layer's backward gets it in training; its program has no operation on the cotangent but the attention's own
    (``"loss"``, runs <= 39: ``grad`` of ``sum(out * ct)`` with a float32 ``ct``, also converting ``ct`` to bf16).
    Both give the same gradients, bit for bit, for the same ``dO``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.kernel_cases import cotangent_dtype, fwd_bwd, inputs
    from pallas_kernels import api

    S = 256
    q, k, v, do = inputs(S, 0, cotangent_dtype("do"), (4, 2, 32))
    assert do.dtype == jnp.bfloat16 and cotangent_dtype("loss") == jnp.float32
    pos = jnp.arange(S, dtype=jnp.int32)
    f = lambda q, k, v, pos: api.block_sparse_attention(q, k, v, pos, pos, None, impl="xla")  # noqa: E731
    g_do = fwd_bwd(f, "do")(q, k, v, do, pos)
    g_loss = fwd_bwd(f, "loss")(q, k, v, do.astype(jnp.float32), pos)
    for a, b in zip(g_do, g_loss):  # the backward gets the same dO both ways: the same bits
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    def program(cotangent, ct):
        """(the primitives that take the cotangent argument, the float32 values of the output's shape)."""
        jaxpr = jax.make_jaxpr(fwd_bwd(f, cotangent))(q, k, v, ct, pos).jaxpr
        inner = jaxpr.eqns[0].params["jaxpr"].jaxpr  # the jit
        uses = {e.primitive.name for e in inner.eqns if any(x is inner.invars[3] for x in e.invars)}
        full = sum(1 for e in inner.eqns for o in e.outvars if o.aval.shape == q.shape and o.aval.dtype == jnp.float32)
        return uses, full

    (uses_do, full_do), (uses_loss, full_loss) = program("do", do), program("loss", do.astype(jnp.float32))
    assert "mul" in uses_loss and "mul" not in uses_do  # the loss's product (then its convert to bf16): gone
    assert full_do < full_loss, (full_do, full_loss)
    with pytest.raises(ValueError, match="cotangent must be one of"):
        fwd_bwd(f, "grad")
