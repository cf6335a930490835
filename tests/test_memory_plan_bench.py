"""``benchmarks/memory_plan.py`` (issue 20): case overrides load as valid configs for every Qwen2.5
size, OOM children become 'does not fit' rows, the table, and one tiny case end to end on CPU
(measured step, --plan's prediction from the same compiled step)."""

import pytest

from benchmarks import memory_plan as mp
from benchmarks.train_throughput import DEFAULT_CONFIG, bench_config
from mtraining_jax.train.plan import memory_plan
from mtraining_jax.train.state import build_model_config

pytestmark = pytest.mark.usefixtures("jax_compilation_cache")  # the case's step and --plan's: one compile


@pytest.mark.parametrize("size", ["0.5b", "1.5b", "3b", "7b"])
def test_case_overrides_build_the_qwen_shapes(size):
    cfg, _ = bench_config(DEFAULT_CONFIG, mp.case_overrides(size, "selective+offload"), 131072, "mtraining")
    _, m = build_model_config(cfg.model, cfg.config_dir)
    want = {"0.5b": 0.494, "1.5b": 1.544, "3b": 3.086, "7b": 7.616}[size]
    assert abs(m.num_params() / 1e9 - want) < 0.002, m.num_params()
    assert m.remat == "selective" and cfg.optim.offload == "opt_state" and cfg.data.seq_len == 131072
    assert m.layer_backends[:3] == ("cudnn", "cudnn", "mtraining") and m.dtype == "bfloat16"
    assert m.remat_saved_layers == tuple(range(m.num_layers // 2))  # dense 0, 1, then the first sparse ones


def test_variants_failures_and_table():
    assert mp.parse_variant("full") == ("full", "") and mp.parse_variant("save_attn+offload") == ("save_attn", "offload")
    assert "optim.offload_stream=false" in mp.case_overrides("7b", "full+offload_whole")
    with pytest.raises(ValueError, match="variant must be REMAT, REMAT\\+offload or"):
        mp.parse_variant("full+params")
    oom = mp.failure_row("7b", 65536, "save_attn", "XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating")
    assert oom["fits"] is False and oom["error"]
    assert mp.failure_row("7b", 65536, "full", "timeout: no result within 400 s")["fits"] is None
    ok = {"size": "7b", "seq_len": 65536, "variant": "full+offload", "tokens_per_s": 3000.0, "step_ms": 21850.0,
          "peak_gib": 80.0, "plan_peak_gib": 84.0, "plan_error": 0.05, "compile_s": 61.0, "error": None}
    table = mp.format_table([ok, oom])
    assert "| 7b | 65536 | full | opt_state | yes | 3,000 | 21.85 | 80.00 | 84.00 | +5.0% | 61 |" in table
    assert "| 7b | 65536 | save_attn | none | **no** (OOM) |" in table


def test_one_tiny_case_on_cpu():
    row = mp.one_case(DEFAULT_CONFIG, "tiny", 1024, "selective+offload", warmup=0, steps=1)
    assert row["fits"] and row["tokens_per_s"] > 0 and row["loss_finite"]
    assert row["remat"] == "selective" and row["host_state_bytes"] > 0
    # the offloaded state is Adam's two float32 moments of every parameter (and its step count)
    cfg, _ = bench_config(DEFAULT_CONFIG, mp.case_overrides("tiny", "selective+offload"), 1024, "mtraining")
    _, m = build_model_config(cfg.model, cfg.config_dir)
    assert 0 <= row["host_state_bytes"] - 2 * 4 * m.num_params() <= 64
    # the row's plan column is what `mtraining-train --plan` predicts for the same config: an
    # independent compile of the step from abstract inputs (CPU: one memory, host state taken out)
    assert row["plan_peak_bytes"] == memory_plan(cfg).peak
