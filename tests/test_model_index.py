"""The kernel benchmark's ``model`` index family (issue 34, family (e)): indices a model estimates on
its own q/k, turned into the kernels' StepIndex with the heads repeated to the benchmark's count. The
StepIndex must allow exactly the vertical-slash index's pairs (per repeated head) and the kernels
(XLA twin here) must give the masked reference's answer with it."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks.model_index import (cycle_heads, load_indices, main, model_entries, model_seqs, model_step_indices,
                                   model_vs_indices, read_tokens, save_indices)
from mtraining_jax.eval.checkpoints import load_for_eval
from mtraining_jax.eval.recall import layer_qk
from mtraining_jax.model.checkpoint import save_model_checkpoint
from mtraining_jax.model.config import ModelConfig
from mtraining_jax.model.qwen2 import Qwen2ForCausalLM
from mtraining_jax.sparsity.estimate import estimate_index
from mtraining_jax.sparsity.masks import index_to_mask
from pallas_kernels import api
from pallas_kernels.index_format import step_index_to_mask

S, HEADS = 1024, 5
BUDGET = {"vertical_max": 128, "slash_max": 3, "last_q": 64}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("mi")
    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                      num_kv_heads=1, max_position_embeddings=512, attention_backend="reference")
    save_model_checkpoint(Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), d / "ck")
    toks = np.random.default_rng(0).integers(0, 256, 3 * S).astype(np.uint16)
    np.save(d / "tokens.npy", toks)
    return str(d / "ck"), str(d / "tokens.npy"), toks


def test_model_indices_are_the_estimates_of_the_models_own_qk(model):
    ck, path, toks = model
    got = model_step_indices(ck, path, S, HEADS, offset=S, budgets=[BUDGET, dict(BUDGET, slash_max=6)])
    assert [(layer, b["slash_max"]) for layer, b, _, _ in got] == [(0, 3), (0, 6), (1, 3), (1, 6)]  # all layers
    assert (got[1][3] > got[0][3]).all() and (got[3][3] > got[2][3]).all()  # more diagonals: denser
    loaded = load_for_eval(ck)
    import dataclasses
    cfg = dataclasses.replace(loaded.config, max_position_embeddings=S)
    qs, ks, _ = layer_qk(cfg, loaded.params, toks[None, S:2 * S].astype(np.int32))
    pos = jnp.arange(S, dtype=jnp.int32)
    for layer, budget, step, den in got:
        sp = dataclasses.replace(cfg.mtraining_config().sparsity, **budget)
        vs = estimate_index(qs[layer].astype(jnp.float32), ks[layer].astype(jnp.float32), pos, sp)
        want = np.asarray(index_to_mask(vs, S, 64))[0]  # [Hq, S, S] of the model's 2 heads
        causal = np.tril(np.ones((S, S), bool))
        mask = np.asarray(step_index_to_mask(step, S, S, 64))[0] & causal  # [HEADS, S, S]; diagonal tiles: causal
        assert mask.shape[0] == HEADS
        for h in range(HEADS):
            np.testing.assert_array_equal(mask[h], want[h % 2])
        np.testing.assert_allclose(den, want.sum((1, 2)) / causal.sum(), rtol=1e-6)
        assert 0.05 < den.min() and den.max() < 0.9  # sparse: the budgets bind at this length
        # the kernels' XLA twin with this index = attention masked by the index
        kq, kk, kv = jax.random.split(jax.random.PRNGKey(layer), 3)
        q = jax.random.normal(kq, (1, S, HEADS, 32), jnp.float32)
        k = jax.random.normal(kk, (1, S, 1, 32), jnp.float32)
        v = jax.random.normal(kv, (1, S, 1, 32), jnp.float32)
        out = api.block_sparse_attention(q, k, v, pos, pos, step, impl="xla")
        s = jnp.einsum("bqhd,bkd->bhqk", q, k[:, :, 0]) / np.sqrt(32)
        s = jnp.where(jnp.asarray(mask)[None], s, -jnp.inf)
        ref = jnp.einsum("bhqk,bkd->bqhd", jax.nn.softmax(s, -1), v[:, :, 0])
        chex.assert_trees_all_close(out, ref, atol=2e-5, rtol=2e-5)


def test_model_index_inputs_are_checked(model):
    ck, path, _ = model
    with pytest.raises(ValueError, match=r"holds 3072 tokens: no window of 2048 at offset 2048"):
        read_tokens(path, 2048, 2048)
    with pytest.raises(ValueError, match=r"layers \[5\] are not layers of the 2-layer model"):
        model_step_indices(ck, path, S, HEADS, layers=[5])
    with pytest.raises(ValueError, match=r"budget fields \['slashes'\] are not SparsityConfig fields"):
        model_step_indices(ck, path, S, HEADS, budgets=[{"slashes": 3}])
    idx = cycle_heads(jax.tree.map(lambda a: a[:, :1], model_step_indices(ck, path, S, 2, layers=[0],
                                                                           budgets=[BUDGET])[0][2]), 3)
    assert idx.block_count.shape[1] == 3


def test_model_flags_of_the_kernel_benchmark():
    import argparse

    from benchmarks.model_index import add_model_args, model_options

    ap = argparse.ArgumentParser()
    add_model_args(ap)
    assert model_options(ap.parse_args([]), ap) is None
    got = model_options(ap.parse_args(["--model-ckpt", "c", "--model-tokens", "t.npy", "--model-layers", "1,6",
                                       "--model-budgets", ";last_q=1024,vertical_min=1024"]), ap)
    assert got == dict(ckpt="c", tokens_path="t.npy", layers=[1, 6],
                       budgets=[{}, {"last_q": 1024, "vertical_min": 1024}])
    assert model_options(ap.parse_args(["--model-index", "m.npz", "--model-layers", "6"]), ap) == dict(
        index="m.npz", layers=[6])
    for bad in (["--model-ckpt", "c"], ["--model-ckpt", "c", "--model-tokens", "t", "--model-layers", "x"],
                ["--model-index", "m.npz", "--model-ckpt", "c", "--model-tokens", "t"],
                ["--model-index", "m.npz", "--model-budgets", "last_q=64"]):
        with pytest.raises(SystemExit):
            model_options(ap.parse_args(bad), ap)


def test_an_mtraining_model_gives_its_sparse_layers(tmp_path, model):
    """A model with MTraining layers (they need a mesh: one device) gives those layers by default."""
    _, path, _ = model
    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                      num_kv_heads=1, max_position_embeddings=512, attention_backend="mtraining", dense_layers=[0],
                      dense_backend="reference")
    save_model_checkpoint(Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), tmp_path / "mt")
    ((layer, budget, step, den),) = model_step_indices(str(tmp_path / "mt"), path, S, HEADS, budgets=[BUDGET])
    assert layer == 1 and budget == BUDGET and step.block_count.shape == (1, HEADS, S // 64)
    assert den.shape == (2,) and (0 < den).all() and (den < 1).all()


def test_saved_indices_time_the_same_index_as_the_checkpoint(tmp_path, model, capsys):
    """An index saved by ``python -m benchmarks.model_index`` gives the kernel benchmark the same StepIndex
    and density as the checkpoint it came from; a file of another length, block size or kind is refused."""
    ck, path, _ = model
    budgets = [BUDGET, dict(BUDGET, slash_max=6)]
    out = tmp_path / "idx.npz"
    assert main(["--ckpt", ck, "--tokens", path, "--seq-len", str(S), "--offset", str(S), "--layers", "0,1",
                 "--budgets", "vertical_max=128,slash_max=3,last_q=64;vertical_max=128,slash_max=6,last_q=64",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("density mean") == 4 and str(out) in printed
    entries, meta = load_indices(str(out))
    assert (meta["seq_len"], meta["block_size"], meta["offset"]) == (S, 64, S) and meta["commit"]
    assert [(e[0], e[1]) for e in entries] == [(0, budgets[0]), (0, budgets[1]), (1, budgets[0]), (1, budgets[1])]
    want = model_vs_indices(ck, path, S, offset=S, budgets=budgets)
    for (_, _, a), (_, _, b) in zip(entries, want):
        chex.assert_trees_all_equal(a, b)
    from_file = model_entries(S, HEADS, 64, dict(index=str(out), layers=[1]))
    from_ckpt = model_entries(S, HEADS, 64, dict(ckpt=ck, tokens_path=path, offset=S, layers=[1], budgets=budgets))
    assert [(e[0], e[1]) for e in from_file] == [(1, budgets[0]), (1, budgets[1])]
    for (_, _, a, da), (_, _, b, db) in zip(from_file, from_ckpt):
        chex.assert_trees_all_equal(a, b)
        np.testing.assert_array_equal(da, db)
    with pytest.raises(ValueError, match=r"holds indices of S=1024, block 64; the benchmark times S=2048, block 64"):
        model_entries(2 * S, HEADS, 64, dict(index=str(out)))
    with pytest.raises(ValueError, match=r"holds layers \[0, 1\], not \[4\]"):
        model_entries(S, HEADS, 64, dict(index=str(out), layers=[1, 4]))
    np.save(tmp_path / "x.npy", np.zeros(3))
    with pytest.raises(ValueError, match=r"is not a model index file"):
        load_indices(str(tmp_path / "x.npy"))
    with pytest.raises(ValueError, match=r"meta\['block_size'\] must be an int"):
        save_indices(str(tmp_path / "y.npz"), entries, dict(seq_len=S))
    assert main(["--ckpt", ck, "--tokens", path, "--seq-len", str(S), "--layers", "7", "--out", str(out)]) == 1
    assert "layers [7] are not layers of the 2-layer model" in capsys.readouterr().err


def test_kernel_benchmark_times_a_saved_index_only_at_its_length(tmp_path, model, monkeypatch, capsys):
    """``benchmarks/kernels.py --seqs 32768,131072 --model-index <a 128K file>`` timed the 32K rows and then
    died on the file's length (session 48); now the file's family runs at its own length only, and a run
    that times none of it is refused before any timing, naming the file and its length."""
    from benchmarks import kernels

    ck, path, _ = model
    out = tmp_path / "idx.npz"
    assert main(["--ckpt", ck, "--tokens", path, "--seq-len", str(S), "--layers", "1", "--out", str(out)]) == 0
    assert model_seqs(dict(index=str(out)), [S // 2, S, 2 * S]) == [S]
    assert model_seqs(dict(index=str(out)), [2 * S]) == []
    assert model_seqs(dict(ckpt=ck, tokens_path=path), [S, 2 * S]) == [S, 2 * S]  # a checkpoint: any length
    assert model_seqs(None, [S]) == []
    for argv, want in (([f"--seqs={2 * S}", "--model-index", str(out)],
                        rf"holds indices of S={S}; none of the timed lengths \[{2 * S}\] is it"),
                       ([f"--seqs={2 * S}", "--only-sweeps", f"--passes={S // 2}", "--model-index", str(out)],
                        rf"none of the timed lengths \[{S // 2}\] is it"),
                       ([f"--seqs={S}", "--model-index", str(tmp_path / "missing.npz")], r"is not a model index file")):
        monkeypatch.setattr("sys.argv", ["kernels.py", *argv])
        monkeypatch.setattr(kernels, "run", lambda *a, **k: pytest.fail("timed before refusing"))
        with pytest.raises(SystemExit) as e:
            kernels.main()
        assert e.value.code == 2
        assert re.search(want, capsys.readouterr().err)
