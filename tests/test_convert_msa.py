"""``mtraining-convert`` keeps the MSA index branch both ways (issue 36, finding 4), refuses an index
file it cannot place, reports clear one-line errors for a bad ``config.json`` value, and never
leaves a temporary folder behind (Ctrl-C, a killed conversion)."""

import json
import os
import socket

import jax
import numpy as np
import pytest
import yaml
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from mtraining_jax.model.checkpoint import save_model_checkpoint
from mtraining_jax.model.config import ModelConfig
from mtraining_jax.model.convert_cli import build_parser
from mtraining_jax.model.convert_cli import main as convert_main
from mtraining_jax.model.hf_io import MSA_INDEX_FILE, load_hf_checkpoint, model_params
from mtraining_jax.model.qwen2 import Qwen2ForCausalLM

MSA = dict(attention_backend="msa", dense_layers=[0], dense_backend="reference", layout="contiguous",
           msa={"index_dim": 16, "top_k": 2, "block_size": 64, "recall_blocks": 1, "pooling": "max",
                "selection": "block_mean"})


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """Our checkpoint of a 2-layer model, layer 1 MSA (as a training run's model.yaml has it)."""
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=32, attention_impl="xla", name="tiny-msa",
                      **{**MSA, "dense_layers": (0,)})
    path = tmp_path_factory.mktemp("ours") / "ck"
    save_model_checkpoint(Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), path)
    return path


def _leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_msa_index_round_trip_through_the_converter(ours, tmp_path, capsys):
    hf, back = tmp_path / "hf", tmp_path / "back"
    assert convert_main(["ours-to-hf", str(ours), str(hf), "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == (f"wrote {hf}: 2 safetensors file(s) (msa_index.safetensors: the MSA index "
                                       "branch), float32\n")
    assert sorted(os.listdir(hf)) == ["config.json", "model.safetensors", MSA_INDEX_FILE]
    assert "msa" not in json.loads((hf / "config.json").read_text())  # a plain Qwen2 config for transformers
    with safe_open(str(hf / MSA_INDEX_FILE), framework="np") as f:
        assert json.loads(f.metadata()["mtraining_msa"]) == {**MSA, "attention_backends": None}
    assert sorted(load_file(str(hf / MSA_INDEX_FILE))) == [
        f"model.layers.{i}.self_attn.index_{w}.weight" for i in (0, 1) for w in ("k", "q")]
    assert convert_main(["hf-to-ours", str(hf), str(back)]) == 0
    assert "MSA index branch of 1 msa layer(s)" in capsys.readouterr().out
    saved = yaml.safe_load((back / "model.yaml").read_text())
    assert {k: saved[k] for k in MSA} == MSA and saved["attention_backends"] is None
    cfg_hf, _ = load_hf_checkpoint(hf)  # also what the evaluation reads from an HF dir
    assert cfg_hf.layer_backends == ("reference", "msa") and cfg_hf.msa_index_dim == 16
    from mtraining_jax.model.checkpoint import load_model_checkpoint

    _, m_ours = load_model_checkpoint(ours)
    _, m_back = load_model_checkpoint(back)
    want, got = _leaves(model_params(m_ours)), _leaves(model_params(m_back))
    assert set(want) == set(got) and any("index_q" in k for k in want)
    for k in want:  # float32 both ways: bit-exact, the index branch included
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # a second ours-to-hf writes the same index file again
    assert convert_main(["ours-to-hf", str(back), str(tmp_path / "hf2"), "--dtype", "float32"]) == 0
    for k, v in load_file(str(hf / MSA_INDEX_FILE)).items():
        np.testing.assert_array_equal(load_file(str(tmp_path / "hf2" / MSA_INDEX_FILE))[k], v, err_msg=k)


def test_index_file_without_settings_is_refused_and_bad_values_are_one_line(ours, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert convert_main(["ours-to-hf", str(ours), str(hf)]) == 0
    capsys.readouterr()
    f = hf / MSA_INDEX_FILE
    save_file(load_file(str(f)), str(f), metadata={"format": "pt"})  # an index file of an older export
    assert convert_main(["hf-to-ours", str(hf), str(tmp_path / "o1")]) == 2
    assert capsys.readouterr().err == (
        f"mtraining-convert: error: {f} holds an MSA index branch but not the model's MSA settings (metadata key "
        "'mtraining_msa'), so which layers are msa is unknown; re-export it with `mtraining-convert ours-to-hf`, or "
        "delete the file to import the dense model only\n")
    f.unlink()
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "vocab_size": "lots"}))
    assert convert_main(["hf-to-ours", str(hf), str(tmp_path / "o2")]) == 2
    assert capsys.readouterr().err == (f"mtraining-convert: error: {hf / 'config.json'}: vocab_size must be a positive "
                                       "integer, got 'lots'\n")
    with pytest.raises(ValueError, match=r"^config.json rms_norm_eps must be a number, got 'tiny'$"):
        ModelConfig.from_hf_config({**cfg, "rms_norm_eps": "tiny"})
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder


def test_interrupted_and_killed_conversions_leave_no_temporary_folder(ours, tmp_path, capsys, monkeypatch):
    import orbax.checkpoint as ocp

    dst = tmp_path / "out"
    killed = tmp_path / f".hf.tmp-{socket.gethostname().replace('-', '_')}-999999999"  # a pid that is not running
    (killed / "params").mkdir(parents=True)
    other = tmp_path / ".hf.tmp-otherhost-1"  # another host's: left alone
    other.mkdir()
    hf = tmp_path / "hf"
    assert convert_main(["ours-to-hf", str(ours), str(hf)]) == 0
    assert not killed.exists() and other.exists()

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", ctrl_c)
    assert convert_main(["hf-to-ours", str(hf), str(dst)]) == 130
    assert capsys.readouterr().err == f"mtraining-convert: interrupted (Ctrl-C): nothing written to {dst}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hf.tmp-otherhost-1", "hf"]
    help_text = build_parser().format_help()
    assert "130  interrupted by Ctrl-C (SIGINT)" in help_text and "143  terminated (SIGTERM)" in help_text
