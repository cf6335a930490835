"""Hugging Face import/export: logits parity with transformers (CPU torch), bit-exact round trips,
sharding, bfloat16, clear errors on bad checkpoints, and the mtraining-convert CLI."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from mtraining_jax.model.convert_cli import main as convert_main
from mtraining_jax.model.hf_io import (
    CheckpointMismatchError,
    load_hf_checkpoint,
    model_params,
    read_hf_tensors,
    save_hf_checkpoint,
)

VOCAB, SEQ = 128, 48
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16, "beta_slow": 1}


def _hf_model(tie: bool, yarn: bool, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie, rope_theta=10000.0,
        rms_norm_eps=1e-5, rope_scaling=dict(YARN) if yarn else None,
    )
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial biases and norm weights
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def _our_logits(model, tokens):
    return np.asarray(model.logits(jnp.asarray(tokens), jnp.arange(tokens.shape[1], dtype=jnp.int32)))


TOKENS = np.random.RandomState(0).randint(0, VOCAB, (2, SEQ))
COMBOS = [(True, False), (False, False), (True, True), (False, True)]


@pytest.fixture(scope="module", params=COMBOS, ids=lambda c: f"tie={c[0]}-yarn={c[1]}")
def hf_dir(request, tmp_path_factory):
    tie, yarn = request.param
    model = _hf_model(tie, yarn)
    path = tmp_path_factory.mktemp(f"hf_tie{tie}_yarn{yarn}")
    model.save_pretrained(path)
    return path, model, _hf_logits(model, TOKENS)


def test_import_matches_transformers_logits(hf_dir):
    path, _, ref = hf_dir
    cfg, model = load_hf_checkpoint(path)
    assert cfg.rms_norm_eps == 1e-5
    out = _our_logits(model, TOKENS)
    assert out.shape == ref.shape == (2, SEQ, VOCAB)
    assert np.abs(out - ref).max() <= 1e-4, np.abs(out - ref).max()
    assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero logits


def test_yarn_changes_the_logits():
    """Guard against a parity test that would pass with YaRN ignored."""
    a = _hf_logits(_hf_model(True, False), TOKENS)
    b = _hf_logits(_hf_model(True, True), TOKENS)
    assert np.abs(a - b).max() > 1e-2


def test_export_reimport_bit_exact_and_loads_in_transformers(hf_dir, tmp_path):
    path, hf_model, ref = hf_dir
    cfg, model = load_hf_checkpoint(path)
    save_hf_checkpoint(model, tmp_path / "out", dtype="float32")
    orig, back = read_hf_tensors(path), read_hf_tensors(tmp_path / "out")
    expected = set(orig) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert set(back) == expected
    for k in expected:
        assert back[k].dtype == np.float32
        np.testing.assert_array_equal(back[k], orig[k], err_msg=k)
    cfg2, model2 = load_hf_checkpoint(tmp_path / "out")
    assert cfg2.replace(name="") == cfg.replace(name="")
    jax.tree.map(np.testing.assert_array_equal, model_params(model2), model_params(model))
    reloaded = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_array_equal(_hf_logits(reloaded, TOKENS), ref)


def test_sharded_export_and_import(tmp_path):
    src = tmp_path / "src"
    _hf_model(False, True, seed=1).save_pretrained(src)
    cfg, model = load_hf_checkpoint(src)
    files = save_hf_checkpoint(model, tmp_path / "sharded", dtype="float32", max_shard_bytes=40_000)
    assert len(files) > 2
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    _, model2 = load_hf_checkpoint(tmp_path / "sharded")
    jax.tree.map(np.testing.assert_array_equal, model_params(model2), model_params(model))
    reloaded = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "sharded").eval()
    assert np.abs(_hf_logits(reloaded, TOKENS) - _our_logits(model, TOKENS)).max() <= 1e-4


def test_bfloat16_export_and_import(tmp_path):
    src = tmp_path / "src"
    _hf_model(True, False, seed=2).save_pretrained(src)
    _, model = load_hf_checkpoint(src)
    save_hf_checkpoint(model, tmp_path / "bf16", dtype="bfloat16")
    t = read_hf_tensors(tmp_path / "bf16")
    assert all(a.dtype == ml_dtypes.bfloat16 for a in t.values())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    cfg32, m32 = load_hf_checkpoint(tmp_path / "bf16")  # bf16 -> f32 is exact
    cfg16, m16 = load_hf_checkpoint(tmp_path / "bf16", param_dtype="bfloat16")
    rounded = jax.tree.map(lambda a: np.asarray(a).astype(ml_dtypes.bfloat16), model_params(model))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a).astype(ml_dtypes.bfloat16), b),
                 model_params(m32), rounded)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(model_params(m16)))
    # and bf16 round trip through our export is bit exact
    save_hf_checkpoint(m16, tmp_path / "bf16b")
    t2 = read_hf_tensors(tmp_path / "bf16b")
    for k in t:
        np.testing.assert_array_equal(t2[k].view(np.uint16), t[k].view(np.uint16))
    hf = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    assert np.abs(_hf_logits(hf, TOKENS) - _our_logits(m32, TOKENS)).max() <= 1e-4


# --------------------------------------------------------------------------- bad checkpoints
@pytest.fixture()
def good_dir(tmp_path):
    path = tmp_path / "good"
    _hf_model(False, False, seed=3).save_pretrained(path)
    return path


def _rewrite(path, fn):
    f = path / "model.safetensors"
    tensors = fn(dict(load_file(str(f))))
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_missing_unexpected_and_misshaped_tensors_are_all_listed(good_dir):
    def corrupt(t):
        del t["model.layers.1.self_attn.k_proj.bias"]
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:, :10].copy()
        t["model.layers.7.mlp.up_proj.weight"] = np.zeros((2, 2), np.float32)
        return t

    _rewrite(good_dir, corrupt)
    with pytest.raises(CheckpointMismatchError) as e:
        load_hf_checkpoint(good_dir)
    err = e.value
    assert err.missing == ["model.layers.1.self_attn.k_proj.bias"]
    assert err.unexpected == ["model.layers.7.mlp.up_proj.weight"]
    assert err.mis_shaped == [("model.layers.0.mlp.up_proj.weight", (96, 10), (96, 64))]
    msg = str(err)
    for s in ("missing tensors", "k_proj.bias", "unexpected tensors", "layers.7", "got (96, 10), expected (96, 64)"):
        assert s in msg
    assert isinstance(err, ValueError)


def test_tied_checkpoint_with_different_lm_head_is_rejected(tmp_path):
    path = tmp_path / "tied"
    _hf_model(True, False, seed=4).save_pretrained(path)

    def add_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1
        return t

    _rewrite(path, add_head)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        load_hf_checkpoint(path)


def test_unknown_architecture(good_dir):
    cfg = json.loads((good_dir / "config.json").read_text())
    (good_dir / "config.json").write_text(json.dumps({**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        load_hf_checkpoint(good_dir)
    (good_dir / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen2ForSequenceClassification"]}))
    with pytest.raises(ValueError, match="Qwen2ForSequenceClassification"):
        load_hf_checkpoint(good_dir)


def test_missing_files_name_the_path(good_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_hf_checkpoint(tmp_path / "nowhere")
    (good_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors.index.json"):
        load_hf_checkpoint(good_dir)
    (good_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        load_hf_checkpoint(good_dir)
    (good_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(good_dir)


# --------------------------------------------------------------------------- CLI
def test_convert_cli_round_trip(good_dir, tmp_path, capsys):
    ours, back = tmp_path / "ours", tmp_path / "back"
    assert convert_main(["hf-to-ours", str(good_dir), str(ours)]) == 0
    assert (ours / "model.yaml").is_file() and (ours / "params").is_dir()
    assert convert_main(["ours-to-hf", str(ours), str(back), "--dtype", "float32", "--max-shard-size", "100KB"]) == 0
    a, b = read_hf_tensors(good_dir), read_hf_tensors(back)
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert convert_main(["ours-to-hf", str(tmp_path / "missing"), str(tmp_path / "x")]) == 2
    assert f"model checkpoint not found: {tmp_path / 'missing'}" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert convert_main(["ours-to-hf", str(tmp_path / "empty"), str(tmp_path / "x")]) == 2
    assert "expected model.yaml + params/" in capsys.readouterr().err


def test_convert_into_an_existing_destination_touches_nothing(good_dir, tmp_path, capsys):
    """Finding 2: without --force nothing in DST changes and the message names --force; with
    --force a failing conversion still leaves DST as it was (written to a temporary folder)."""
    dst = tmp_path / "ours"
    assert convert_main(["hf-to-ours", str(good_dir), str(dst)]) == 0
    before = {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    other = tmp_path / "other"
    _hf_model(False, False, seed=9).save_pretrained(other)
    capsys.readouterr()  # transformers' own progress output
    assert convert_main(["hf-to-ours", str(other), str(dst)]) == 2
    err = capsys.readouterr().err
    assert f"destination {dst} exists and is not empty; pass --force" in err and len(err.splitlines()) == 1
    (other / "model.safetensors").write_bytes(b"not a safetensors file")
    assert convert_main(["hf-to-ours", str(other), str(dst), "--force"]) == 2
    err = capsys.readouterr().err
    assert f"cannot read {other / 'model.safetensors'} (corrupt" in err and len(err.splitlines()) == 1
    assert {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good", "other", "ours"]  # no temporary folder left
    hf_out = tmp_path / "hf"
    hf_out.mkdir()
    (hf_out / "keep.txt").write_text("x")
    assert convert_main(["ours-to-hf", str(dst), str(hf_out)]) == 2
    assert "pass --force" in capsys.readouterr().err and (hf_out / "keep.txt").is_file()
    assert convert_main(["ours-to-hf", str(dst), str(hf_out), "--force"]) == 0
    assert sorted(p.name for p in hf_out.iterdir()) == ["config.json", "model.safetensors"]


def test_bad_config_json_is_one_line_naming_the_file(good_dir, capsys):
    cfg = json.loads((good_dir / "config.json").read_text())
    del cfg["vocab_size"]
    (good_dir / "config.json").write_text(json.dumps(cfg))
    assert convert_main(["hf-to-ours", str(good_dir), str(good_dir.parent / "o1")]) == 2
    err = capsys.readouterr().err
    assert f"{good_dir / 'config.json'} lacks required key(s) ['vocab_size']" in err and len(err.splitlines()) == 1
    (good_dir / "config.json").write_text('{"model_type": "qwen2",\n "vocab_size": }')
    assert convert_main(["hf-to-ours", str(good_dir), str(good_dir.parent / "o2")]) == 2
    assert f"{good_dir / 'config.json'}:2:" in capsys.readouterr().err
