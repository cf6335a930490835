"""Training config: YAML + dotted overrides, validation messages, shipped configs, LR schedule."""

import os

import numpy as np
import pytest

from mtraining_jax.train.config import apply_overrides, load_config, parse_override
from mtraining_jax.train.optim import decay_mask, lr_schedule
from mtraining_jax.train.state import build_model_config

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIGS = ["tiny_cpu.yaml", "qwen2.5-0.5b-128k.yaml", "qwen2.5-3b-512k.yaml", "qwen2.5-0.5b-continue-128k.yaml"]


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_load_and_resolve_their_model(name):
    cfg = load_config(os.path.join(ROOT, "configs", name))
    _, mcfg = build_model_config(cfg.model, cfg.config_dir)
    assert mcfg.vocab_size >= 259
    if cfg.mesh.shape is not None:
        n, l = cfg.mesh.shape
        from mtraining_jax.train.loop import run_layout

        assert cfg.data.seq_len % (run_layout(cfg, mcfg, n * l).stripe * n * l) == 0
    assert mcfg.max_position_embeddings >= cfg.data.seq_len


def test_paper_setup_config():
    cfg = load_config(os.path.join(ROOT, "configs", "qwen2.5-3b-512k.yaml"))
    _, m = build_model_config(cfg.model, cfg.config_dir)
    assert cfg.data.seq_len == 512 * 1024 and tuple(cfg.mesh.shape) == (4, 8)
    assert m.rope_scaling["rope_type"] == "yarn" and m.rope_scaling["factor"] == 32.0
    assert m.hidden_size == 2048 and m.num_layers == 36
    assert cfg.optim.grad_accum == 64
    assert m.attention_backend == "mtraining"  # the paper trains sparse attention in every layer


def test_overrides_are_typed_and_applied():
    cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"),
                      ["optim.lr=3e-4", "mesh.shape=[1,8]", "steps=7", "checkpoint.async_save=false",
                       "model.attention_backend=reference", "data.source=passkey"])
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.mesh.shape == (1, 8) and cfg.steps == 7 and cfg.checkpoint.async_save is False
    assert cfg.data.source == "passkey"
    _, m = build_model_config(cfg.model, cfg.config_dir)
    assert m.attention_backend == "reference" and m.hidden_size == 128
    assert parse_override("a.b=1e-3") == (["a", "b"], 1e-3)
    assert apply_overrides({"a": {"x": 1}}, ["a.y=[1, 2]"]) == {"a": {"x": 1, "y": [1, 2]}}


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.learning_rate=1", "unknown config key(s) optim.learning_rate"),
        ("bogus=1", "unknown config key(s) ['bogus']"),
        ("optim.lr=-1", "optim.lr must be a positive number, got -1.0"),
        ("optim.lr=abc", "optim.lr must be a number, got 'abc'"),
        ("steps=2.5", "steps must be an integer, got 2.5"),
        ("data.source=web", "data.source must be one of"),
        ("mesh.shape=[2]", "mesh.shape must be [node, local]"),
        ("checkpoint.async_save=maybe", "checkpoint.async_save must be true or false, got 'maybe'"),
        ("data.seq_len=0", "data.seq_len must be a positive number, got 0"),
        ("optim.b2=1.5", "optim.b2 must be in [0, 1)"),
        ("optim", "must look like section.key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ValueError) as e:
        load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), [override])
    assert message in str(e.value)


def test_bad_model_fields_and_missing_files():
    cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), ["model.hidden_sise=3"])
    with pytest.raises(ValueError, match="hidden_sise"):
        build_model_config(cfg.model, cfg.config_dir)
    cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), ["model.path=model/none.yaml"])
    with pytest.raises(ValueError, match="model/none.yaml"):
        build_model_config(cfg.model, cfg.config_dir)
    with pytest.raises(ValueError, match="does not exist"):
        load_config("/no/such/config.yaml")
    with pytest.raises(ValueError, match="data.path is required"):
        load_config(None, ["data.source=tokens"])


def test_lr_schedule_warmup_then_cosine():
    f = lr_schedule(1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    got = np.array([float(f(t)) for t in range(16)])
    np.testing.assert_allclose(got[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)
    u = (np.arange(4, 16) - 4) / 10
    want = 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * np.clip(u, 0, 1)))
    np.testing.assert_allclose(got[4:], want, rtol=1e-6)
    assert got[14] == pytest.approx(0.1) and np.all(np.diff(got[3:]) <= 1e-7)


def test_weight_decay_only_on_matrices():
    params = {"embed_tokens": {"embedding": 1}, "layers": {"q_proj": {"kernel": 1, "bias": 1},
              "input_layernorm": {"weight": 1}}, "lm_head": 1, "norm": {"weight": 1}}
    m = decay_mask(params)
    assert m == {"embed_tokens": {"embedding": True}, "layers": {"q_proj": {"kernel": True, "bias": False},
                 "input_layernorm": {"weight": False}}, "lm_head": True, "norm": {"weight": False}}


def test_continue_recipe_starts_from_a_pretrained_checkpoint_with_yarn():
    cfg = load_config(os.path.join(ROOT, "configs", "qwen2.5-0.5b-continue-128k.yaml"))
    _, m = build_model_config(cfg.model, cfg.config_dir)
    assert cfg.model.init_source == ("hf", "/path/to/Qwen2.5-0.5B")
    assert m.rope_scaling["rope_type"] == "yarn" and m.rope_scaling["factor"] == 4.0
    assert m.rope_scaling["original_max_position_embeddings"] * 4 == cfg.data.seq_len == m.max_position_embeddings
    assert cfg.data.source == "tokens" and cfg.data.token_dtype == "uint32"


@pytest.mark.parametrize("name", ["qwen2.5-0.5b-128k.yaml", "qwen2.5-0.5b-continue-128k.yaml"])
def test_128k_configs_compile_one_forward_kernel(name):
    """The Qwen2.5-0.5B 128K configs run the Mosaic forward on the split stream only (``model.ring.kernel_stream``;
    train_throughput.md run 35: 3 s less compile, same step); an override still wins."""
    cfg = load_config(os.path.join(ROOT, "configs", name))
    assert build_model_config(cfg.model, cfg.config_dir)[1].ring.kernel_stream == "split"
    cfg = load_config(os.path.join(ROOT, "configs", name), ["model.ring.kernel_stream=auto"])
    assert build_model_config(cfg.model, cfg.config_dir)[1].ring.kernel_stream == "auto"


def test_loader_layout_derives_from_the_model_config():
    """``data.layout`` / ``data.stripe`` default to the model's layout and sparse block size; given
    and contradicting the MTraining attention, they are rejected naming both."""
    from mtraining_jax.train.loop import run_layout

    base = ["model.attention_backend=mtraining", "data.seq_len=4096"]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), base + ["model.layout=zigzag"])
    _, mcfg = build_model_config(cfg.model, cfg.config_dir)
    assert cfg.data.layout is None and cfg.data.stripe is None
    lay = run_layout(cfg, mcfg, 8)
    assert (lay.name, lay.stripe, lay.seq_len, lay.num_ranks) == ("zigzag", 64, 4096, 8)
    cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), base + ["data.stripe=128"])
    _, mcfg = build_model_config(cfg.model, cfg.config_dir)
    assert run_layout(cfg, mcfg, 8).stripe == 128  # explicit wins (checked against the model in the loop)


TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")


def test_deterministic_option(monkeypatch):
    """``deterministic: true`` puts XLA's deterministic-ops flag in XLA_FLAGS once, a GPU backend
    started without it is refused with the flag named, and a non-boolean is refused."""
    import jax

    from mtraining_jax.train import determinism
    from mtraining_jax.train.config import load_config

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    determinism.request(False)
    assert determinism.FLAG not in os.environ["XLA_FLAGS"]
    determinism.request(True)
    determinism.request(True)
    assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8", determinism.FLAG]
    determinism.check(True)  # flag set
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="xla_gpu_deterministic_ops"):
        determinism.check(True)
    determinism.check(False)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    determinism.check(True)  # CPU steps are deterministic already
    assert load_config(TINY, ["deterministic=true"]).deterministic is True
    with pytest.raises(ValueError, match="deterministic"):
        load_config(TINY, ["deterministic=yes please"])
