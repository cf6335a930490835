"""The floor a Mosaic pass's loads set: each pass timed as built and with its tile math removed.

``python -m benchmarks.kernels --passes S ... --loads-only`` compiles every Mosaic pass twice: as built
(``variant: full``) and inside :func:`loads_only` (``variant: load_only``), where every tile's
``wgmma`` / softmax / mask work is replaced by the waits and arrivals the tile owes its barriers. The
producer's TMA stream, the ring's barriers and the consumers' turns stay, so ``load_only`` is the time
the pass's K/V (forward, dQ) or Q/dO (dK/dV passes) stream takes by itself on that index: no kernel
that moves the same bytes in the same order runs faster. Full / load-only near 1 means the pass waits
on memory, not on the tensor cores (results/kernels/kernels.md run 33).

The swap relies on two seams of the kernels, and only here: the consumers' walk
(:func:`pallas_kernels.mosaic_stream.walk_stream`, called by the forward and dQ with a ``tile`` and a
``skip`` body: load-only passes ``skip`` for both) and the dK/dV passes' consumer
(:func:`pallas_kernels.mosaic_dkv._dkv_consumer`: replaced by one that waits for each tile's copies and
frees its slot). Outputs of a load-only kernel are zeros / garbage: timing only.
"""

from __future__ import annotations

import contextlib
import statistics

import jax
import jax.numpy as jnp
from jax import lax


def _walk_loads_only(walk_stream):
    def walk_loads_only(w, bounds, n_union, total, row, tile, skip, carry, walk="loops", split=False):
        def no_math(t, c, masked=False, thr=None, own=False):
            return skip(t, c)
        return walk_stream(w, bounds, n_union, total, row, no_math, skip, carry, walk, split)
    return walk_loads_only


def _dkv_consumer_loads_only(w, loops, kres, vres, kpos_b, kaux_b, smems, bars, *, stages: int, bs: int,
                             qk_scale: float, scale: float, dtype, kseg_smem=None, shared: bool = False):
    """:func:`pallas_kernels.mosaic_dkv._dkv_consumer`'s barrier protocol without its math: per tile
    (each kind alike), wait for Q, the row infos, the KV rows' aux (when per tile) and dO, then free
    both slots."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.mosaic_dkv import _dkv_pass_tile, _dkv_slot

    def tile(t, carry):
        _dkv_pass_tile(_dkv_slot(w, t, stages, shared), bars, kaux_b is None)
        return carry

    for lo, hi, *_ in ([(0, loops[0])] if isinstance(loops, tuple) else loops):
        lax.fori_loop(lo, hi, tile, jnp.int32(0))
    zeros = plgpu.layout_cast(jnp.full((bs, kres.shape[-1]), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    return zeros, zeros


@contextlib.contextmanager
def loads_only():
    """Within: the Mosaic forward, dQ and dK/dV kernels traced from here on keep their loads and barriers
    and drop their math (module docstring). JAX's caches are cleared on entry and exit, so no trace
    crosses the boundary either way."""
    from pallas_kernels import mosaic_dkv, mosaic_dq, mosaic_fwd, mosaic_stream

    saved = (mosaic_fwd.walk_stream, mosaic_dq.walk_stream, mosaic_dkv._dkv_consumer)
    jax.clear_caches()
    try:
        mosaic_fwd.walk_stream = mosaic_dq.walk_stream = _walk_loads_only(mosaic_stream.walk_stream)
        mosaic_dkv._dkv_consumer = _dkv_consumer_loads_only
        yield
    finally:
        mosaic_fwd.walk_stream, mosaic_dq.walk_stream, mosaic_dkv._dkv_consumer = saved
        jax.clear_caches()


def _median(rows, key="ms"):
    return statistics.median(r[key] for r in rows)


def floors(rows) -> list:
    """Per (seq, index, Mosaic impl, pass): ``{full_ms, load_ms, ratio}`` (medians over the rounds) from
    ``--loads-only`` rows, and per (seq, index) the sums over the four passes with ``fb_flop`` (3.5x the
    forward's FLOP, the fwd+bwd count of ``benchmarks/kernels.py``) when the forward was timed."""
    out = []
    keys = list(dict.fromkeys((r["seq"], r["index"], r["impl"], r["pass_"]) for r in rows
                              if r.get("variant") == "full"))
    for seq, index, impl, p in keys:
        got = [r for r in rows if (r["seq"], r["index"], r["impl"], r["pass_"]) == (seq, index, impl, p)]
        full = [r for r in got if r["variant"] == "full"]
        load = [r for r in got if r["variant"] == "load_only"]
        if not load:
            continue
        f, lo = _median(full), _median(load)
        out.append(dict(seq=seq, index=index, impl=impl, pass_=p, full_ms=f, load_ms=lo, ratio=lo / f,
                        flop=full[0]["tflops"] * f * 1e9))
    return out


def floors_table(rows) -> str:
    """Markdown: per index, each pass's full and load-only ms (median over rounds), their ratio, and
    the sum over the passes (the operator's four Mosaic passes: what fwd+bwd at the floor would take)."""
    fl = floors(rows)
    lines = ["| index | pass (impl) | full ms | load-only ms | load / full |", "|---|---|---:|---:|---:|"]
    for seq, index in dict.fromkeys((r["seq"], r["index"]) for r in fl):
        got = [r for r in fl if (r["seq"], r["index"]) == (seq, index)]
        for r in got:
            lines.append(f"| {index} ({seq // 1024}K) | {r['pass_']} ({r['impl']}) | {r['full_ms']:.2f} | "
                         f"{r['load_ms']:.2f} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def plot_floors(rows, path) -> None:
    """Per index: each pass's full time (bar) and load-only floor (hatched bar inside it); black lines:
    min-max of the rounds' medians (left of centre: as built, centre: loads only)."""
    from benchmarks.kernels_report import _pyplot, _save

    plt = _pyplot()
    fl = floors(rows)
    indices = list(dict.fromkeys((r["seq"], r["index"]) for r in fl))
    fig, axes = plt.subplots(1, len(indices), figsize=(3.4 * len(indices), 3.8), squeeze=False, sharey=True)
    for ax, (seq, index) in zip(axes[0], indices):
        got = [r for r in fl if (r["seq"], r["index"]) == (seq, index)]
        for i, r in enumerate(got):
            for variant, off in (("full", -0.25), ("load_only", 0.0)):
                runs = [x["ms"] for x in rows if (x["seq"], x["index"], x["impl"], x["pass_"], x.get("variant")) ==
                        (seq, index, r["impl"], r["pass_"], variant)]
                ax.plot([i + off, i + off], [min(runs), max(runs)], color="k", lw=0.8)
            ax.bar(i, r["full_ms"], 0.7, color="C0", label="as built" if i == 0 else None)
            ax.bar(i, r["load_ms"], 0.45, color="C1", hatch="//", label="loads only" if i == 0 else None)
            ax.annotate(f"{r['ratio']:.2f}", (i, r["full_ms"]), ha="center", va="bottom", fontsize=7)
        twice = {r["pass_"] for r in got if sum(x["pass_"] == r["pass_"] for x in got) > 1}  # say the impl
        ax.set_xticks(range(len(got)), [r["pass_"].replace("dkv_", "dkv\n") + (
            "\n" + r["impl"].partition("[")[2].rstrip("]").replace(",", ", ") if r["pass_"] in twice else "")
            for r in got], fontsize=7)
        ax.set_title(f"{index}, {seq // 1024}K".replace("_last_q", "\nlast_q"), fontsize=8)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("ms per pass (label: loads only / as built)")
    _save(fig, "Mosaic passes as built vs their loads alone", path, dpi=110)
