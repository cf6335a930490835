"""benchmarks/plan_check.py: reading --plan's peak from the table the CLI prints, and its arguments."""

import pytest

from benchmarks import plan_check as pc
from mtraining_jax.train.plan import GIB, MemoryPlan


def _plan(temp: int) -> MemoryPlan:
    return MemoryPlan(params=10 * GIB, grads=0, opt_state=20 * GIB, batch=1 << 20, activations=5 * GIB, num_layers=24,
                      argument=30 * GIB + (1 << 20), output=30 * GIB, alias=30 * GIB, temp=temp, device_memory=80 * GIB,
                      fsdp=False, num_devices=1, remat="save_attn")


@pytest.mark.parametrize("temp", [13 * GIB + GIB // 4, 3 << 20])
def test_reads_the_peak_of_the_printed_plan(temp):
    plan = _plan(temp)
    got = pc.parse_plan_peak("compiling...\n" + plan.table() + "\nit fits\n")
    assert got == pytest.approx(plan.peak / GIB, abs=0.005)  # the table prints 2 decimals (GiB) / 1 (MiB)
    assert pc.parse_plan_peak("no plan here") is None


def test_case_arguments():
    assert pc.parse_case("a:optim.grad_accum=1,model.remat=full") == ("a", ["optim.grad_accum=1", "model.remat=full"])
    assert pc.parse_case("plain") == ("plain", [])
    with pytest.raises(ValueError, match="'a:remat'"):
        pc.parse_case("a:remat")


def test_table_row():
    row = dict(case="c", overrides=["x=1"], plan_gib=43.28, run_peak_gib=43.2753, plan_error=0.0001, tokens_per_s=56119.6)
    assert "| c | x=1 | 43.28 | 43.28 | +0.0% | 56,120 |" in pc.format_table([row])
