"""benchmarks/saved_residuals.py: residuals grouped by (shape, dtype, source) with their bytes, the
step's own arguments left out; a config traced as the GPU program saves cuDNN's residuals (not XLA's
[S, S] probabilities) and the patches are undone afterwards; the row carries its provenance."""

import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks.saved_residuals import group, main, source_of, traced_as_gpu

TINY = "configs/tiny_cpu.yaml"


def test_group_sums_bytes_by_shape_dtype_and_source_largest_first():
    a = jax.ShapeDtypeStruct((2, 8), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((4,), jnp.float32)
    res = [(a, "output of add from /x/model/rope.py:110:11 (apply_rope)"),
           (a, "output of add from /x/model/rope.py:120:3 (apply_rope)"),
           (b, "output of jitted function '_where' from /x/dispatch.py:80:11 (_nan_unless)"),
           (a, "from the argument q")]
    got = group(res)
    assert got == [{"shape": [2, 8], "dtype": "bfloat16", "source": "add (rope.py: apply_rope)", "count": 2,
                    "bytes": 64},
                   {"shape": [4], "dtype": "float32", "source": "_where (dispatch.py: _nan_unless)", "count": 1,
                    "bytes": 16}]
    assert source_of("something else") == "something else"


def test_traced_as_gpu_traces_cudnn_and_undoes_its_patches():
    import mtraining_jax.attention.dispatch as dispatch
    from jax._src.ad_checkpoint import saved_residuals

    from mtraining_jax.attention.dispatch import attention

    q = jnp.ones((1, 64, 4, 16), jnp.bfloat16)
    k = jnp.ones((1, 64, 2, 16), jnp.bfloat16)
    f = lambda q, k, v: attention(q, k, v, jnp.arange(64), backend="cudnn").astype(jnp.float32).sum()  # noqa: E731
    cpu = group(saved_residuals(f, q, k, k))
    assert any(g["shape"][-2:] == [64, 64] for g in cpu)  # XLA's fallback keeps the probabilities
    with traced_as_gpu():
        gpu = group(saved_residuals(f, q, k, k))
    assert not any(g["shape"][-2:] == [64, 64] for g in gpu)
    assert {g["source"].split(" ")[0] for g in gpu} >= {"dot_product_attention_fwd_wrapper"}
    assert dispatch.jax is jax  # restored: the rest of the process runs the CPU program
    assert group(saved_residuals(f, q, k, k)) == cpu


def test_main_writes_a_row_with_provenance(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    argv = ["--config", TINY, "--set", "model.attention_backend=cudnn", "--set", "model.dtype=bfloat16", "--top", "50"]
    assert main(argv + ["--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["config"] == TINY and row["overrides"] == ["model.attention_backend=cudnn", "model.dtype=bfloat16"]
    assert row["traced_as"] == "gpu" and row["device"] == "trace" and row["jax"] == jax.__version__
    assert row["total_bytes"] == sum(g["bytes"] for g in row["groups"]) > 0  # --top 50 keeps every group
    assert all(row.get(k) for k in ("commit", "date", "command"))
    assert "total" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--top must be >= 1 \\(got 0\\)"):
        main(["--config", TINY, "--top", "0"])
