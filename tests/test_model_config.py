"""ModelConfig: YAML files, validation errors, HF config round trip; RoPE/YaRN vs transformers."""

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from mtraining_jax.model.config import ModelConfig
from mtraining_jax.model.rope import rope_parameters

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "model"
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_yaml_configs_load(path):
    cfg = ModelConfig.from_yaml(path)
    assert cfg.name == path.stem
    assert cfg.num_heads % cfg.num_kv_heads == 0
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert hash(ModelConfig.from_dict(cfg.to_dict())) == hash(cfg)


def test_qwen25_sizes_have_published_parameter_counts():
    # Qwen2.5 model cards: 0.49B, 1.54B, 3.09B parameters.
    for name, n in (("qwen2.5-0.5b", 0.49e9), ("qwen2.5-1.5b", 1.54e9), ("qwen2.5-3b", 3.09e9)):
        cfg = ModelConfig.from_yaml(CONFIG_DIR / f"{name}.yaml")
        assert abs(cfg.num_params() - n) / n < 0.01, (name, cfg.num_params())


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_heads=8, num_kv_heads=3), r"num_heads \(8\).*num_kv_heads \(3\)"),
        (dict(hidden_size=30), r"hidden_size \(30\).*num_heads \(4\)"),
        (dict(head_dim=7), "head_dim must be even"),
        (dict(num_layers=0), "num_layers"),
        (dict(remat="some"), "remat"),
        (dict(attention_backend="flash"), "attention_backend"),
        (dict(dense_layers=(0, 5)), r"dense_layers \[5\]"),
        (dict(attention_backends=("reference",)), "attention_backends has 1"),
        (dict(ring_order="spiral"), "ring_order"),
        (dict(dtype="int8"), "dtype"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "llama3"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "original_max_position_embeddings"),
    ],
)
def test_validation_errors_name_the_value(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**TINY, **change})


def test_yaml_unknown_key_and_missing_file(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("vocab_size: 8\nhidden_sise: 4\n")
    with pytest.raises(ValueError, match="hidden_sise"):
        ModelConfig.from_yaml(f)
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        ModelConfig.from_yaml(tmp_path / "nope.yaml")


def test_layer_backends():
    cfg = ModelConfig(**TINY, attention_backend="mtraining", dense_layers=(0, 1))
    assert cfg.layer_backends == ("ring", "ring", "mtraining")
    cfg = ModelConfig(**TINY, attention_backend="ring", dense_layers=(2,), dense_backend="reference")
    assert cfg.layer_backends == ("ring", "ring", "reference")
    cfg = ModelConfig(**TINY, attention_backends=("cudnn", "reference", "ring"), dense_layers=(0,))
    assert cfg.layer_backends == ("cudnn", "reference", "ring")


def test_hf_config_roundtrip_both_key_styles():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    cfg = ModelConfig(**TINY, rope_scaling=yarn, tie_word_embeddings=False, rope_theta=5e5)
    hf = cfg.to_hf_config()
    back = ModelConfig.from_hf_config(hf)
    assert back.replace(name="") == cfg
    # transformers-5 style: everything inside rope_parameters
    v5 = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**yarn, "rope_theta": 5e5}
    assert ModelConfig.from_hf_config(v5).replace(name="") == cfg
    # and what transformers itself writes
    written = Qwen2Config(**hf).to_dict()
    assert ModelConfig.from_hf_config(written).replace(name="") == cfg


def test_hf_config_rejects_other_architectures():
    hf = ModelConfig(**TINY).to_hf_config()
    with pytest.raises(ValueError, match="'llama'"):
        ModelConfig.from_hf_config({**hf, "model_type": "llama"})
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        ModelConfig.from_hf_config({**hf, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="sliding"):
        ModelConfig.from_hf_config({**hf, "use_sliding_window": True})


YARN_CASES = [
    None,
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "attention_factor": 1.3},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.8},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512, "truncate": False},
    {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 128},
]


@pytest.mark.parametrize("scaling", YARN_CASES)
@pytest.mark.parametrize("head_dim, theta", [(64, 1e6), (128, 1e4), (16, 1e4)])
def test_rope_parameters_match_transformers(scaling, head_dim, theta):
    hf = Qwen2Config(
        hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        rope_theta=theta, rope_scaling=None if scaling is None else dict(scaling), max_position_embeddings=131072,
    )
    rtype = hf.rope_parameters["rope_type"]
    fn = ROPE_INIT_FUNCTIONS[rtype] if rtype != "default" else _default_rope
    inv_ref, factor_ref = fn(hf)
    inv, factor = rope_parameters(head_dim, theta, scaling)
    # float32 pow may differ by one ulp between libms (torch 2.11 vs 2.13 do): allow 2 ulp
    np.testing.assert_allclose(inv, inv_ref.numpy(), rtol=2.5e-7, atol=0)
    assert factor == pytest.approx(factor_ref, rel=1e-15)


def _default_rope(config):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    return Qwen2RotaryEmbedding.compute_default_rope_parameters(config)


def test_rope_cos_sin_match_transformers():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from mtraining_jax.model.rope import rope_cos_sin

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    hf = Qwen2Config(hidden_size=256, num_attention_heads=4, rope_theta=1e6, rope_scaling=dict(scaling),
                     max_position_embeddings=1024)
    pos = np.random.RandomState(0).permutation(1024).astype(np.int32)
    cos_ref, sin_ref = Qwen2RotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), torch.tensor(pos)[None])
    cos, sin = rope_cos_sin(pos, *rope_parameters(64, 1e6, scaling), np.float32)
    np.testing.assert_allclose(np.asarray(cos), cos_ref[0].numpy(), atol=2e-6)
    np.testing.assert_allclose(np.asarray(sin), sin_ref[0].numpy(), atol=2e-6)


@settings(max_examples=40, deadline=None)
@given(
    head_dim=st.sampled_from([16, 32, 64, 96, 128, 256]),
    theta=st.sampled_from([1e4, 5e5, 1e6, 1e7]),
    factor=st.floats(1.0, 64.0),
    orig=st.sampled_from([256, 2048, 4096, 32768]),
    beta_fast=st.integers(2, 64),
    beta_slow=st.integers(1, 2),
    truncate=st.booleans(),
    attention_factor=st.one_of(st.none(), st.floats(0.5, 2.0)),
)
def test_yarn_matches_transformers_property(head_dim, theta, factor, orig, beta_fast, beta_slow, truncate,
                                            attention_factor):
    scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
               "beta_fast": beta_fast, "beta_slow": beta_slow, "truncate": truncate}
    if attention_factor is not None:
        scaling["attention_factor"] = attention_factor
    hf = Qwen2Config(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_theta=theta,
                     rope_scaling=dict(scaling), max_position_embeddings=131072)
    inv_ref, factor_ref = ROPE_INIT_FUNCTIONS["yarn"](hf)
    inv, af = rope_parameters(head_dim, theta, scaling)
    # float32 both; the two round in a different order: within 4 ulps (2^-23 relative each)
    np.testing.assert_allclose(inv, inv_ref.numpy(), rtol=4 * 2.0**-23, atol=0)
    assert af == pytest.approx(factor_ref, rel=1e-12)


@given(st.lists(st.sampled_from(["reference", "ring", "cudnn"]), min_size=1, max_size=12))
def test_backend_segments_cover_layers_property(backends):
    from mtraining_jax.model.qwen2 import backend_segments

    segs = backend_segments(tuple(backends))
    assert segs[0][0] == 0 and segs[-1][1] == len(backends)
    for (a, b, name), nxt in zip(segs, segs[1:] + [None]):
        assert a < b and all(x == name for x in backends[a:b])
        if nxt is not None:
            assert nxt[0] == b and nxt[2] != name
