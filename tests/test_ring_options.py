"""Ring options (issue 38, item 1): one :class:`RingOptions`, defined in ``ring/config.py``, held by
``MTrainingConfig``, ``MSAConfig`` and ``ModelConfig``, reachable from YAML as ``model.ring.<field>``;
dispatch takes no keyword it would ignore; the index-source contract is one set of protocols. Every
option trains two steps of the tiny CPU config (dense ring layer + MTraining sparse layer on a
1 x 2 mesh) with the same losses as the default (all options are exact)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtraining_jax.attention.dispatch import attention
from mtraining_jax.attention.msa import MSAConfig
from mtraining_jax.attention.mtraining import MTrainingConfig
from mtraining_jax.model.config import ModelConfig
from mtraining_jax.ring import attention as ring_attention_mod
from mtraining_jax.ring.config import RingOptions, ring_options
from mtraining_jax.ring.index_source import FusedIndexSource, GlobalIndexSource, IndexSource
from mtraining_jax.ring.steps import StackedStepIndex
from mtraining_jax.train.config import load_config
from mtraining_jax.train.loop import to_global
from mtraining_jax.train.state import build_model_config

from _tiny_train import CONFIG, tiny_config, token_file, training_parts

pytestmark = pytest.mark.usefixtures("jax_compilation_cache")

TINY = dict(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1)


# ----------------------------------------------------------------------------- the one definition

def test_ring_options_validate_naming_field_and_value():
    assert RingOptions() == RingOptions.from_mapping(None) == RingOptions.from_mapping({})
    for kw, match in [(dict(ring_order="spiral"), "ring_order: unknown ring order 'spiral'"),
                      (dict(backward_ring="q"), "backward_ring: unknown backward_ring 'q'"),
                      (dict(kv_exchange="all"), "kv_exchange: unknown kv_exchange 'all'"),
                      (dict(exchange_capacity=1.5), r"exchange_capacity as a fraction must be in \(0, 1\], got 1.5"),
                      (dict(exchange_capacity="half"), "exchange_capacity must be a token count"),
                      (dict(fuse_forward="no"), "fuse_forward must be a bool, got 'no'"),
                      (dict(fuse_backward=1), "fuse_backward must be a bool, got 1"),
                      (dict(impl="cuda"), "impl: unknown impl 'cuda'"),
                      (dict(kernel_stream="fast"), "kernel_stream: unknown kernel stream 'fast'")]:
        with pytest.raises(ValueError, match=match):
            RingOptions(**kw)
        with pytest.raises(ValueError, match="ring." + match):  # a config section names the dotted key
            RingOptions.from_mapping(kw)
    with pytest.raises(ValueError, match=r"unknown ring keys \['order'\]"):
        RingOptions.from_mapping({"order": "flat"})
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['order'\]"):
        ring_options(order="flat")
    assert ring_options(RingOptions(impl="xla"), ring_order="flat") == RingOptions(ring_order="flat", impl="xla")
    sparse = RingOptions(kv_exchange="sparse", exchange_capacity=0.5, backward_ring="query")
    assert sparse.for_dense() == RingOptions(backward_ring="query")  # a dense ring sends whole chunks
    assert RingOptions.from_mapping(sparse.to_dict()) == sparse and hash(sparse) == hash(RingOptions(**sparse.to_dict()))


def test_configs_hold_the_ring_options():
    opts = RingOptions(ring_order="flat", backward_ring="query", kv_exchange="sparse", exchange_capacity=256,
                       fuse_forward=False, fuse_backward=False, impl="xla")
    assert MTrainingConfig(ring=opts).ring is opts
    assert MTrainingConfig(ring=opts.to_dict()).ring == opts
    msa_opts = opts.replace(backward_ring="kv", kv_exchange="auto")  # MSA: its own queries' index only
    assert MSAConfig(ring=msa_opts.to_dict()).ring == msa_opts
    with pytest.raises(ValueError, match="ring.backward_ring: unknown backward_ring 'both'"):
        MSAConfig(ring={"backward_ring": "both"})
    for cls in (MTrainingConfig, MSAConfig):  # the ring fields are declared once, in RingOptions
        names = {f.name for f in dataclasses.fields(cls)}
        assert not names & set(RingOptions.field_names()), (cls, names)

    m = ModelConfig(**TINY, attention_backend="mtraining", dense_layers=(0,), ring=opts.to_dict())
    assert m.ring == opts and m.mtraining_config().ring == opts
    assert m.attention_spec("mtraining")["mtraining"].ring == opts
    assert m.attention_spec("ring") == {"backend": "ring", "ring": opts.for_dense()}
    assert m.attention_spec("reference") == {"backend": "reference"}
    assert ModelConfig.from_dict(m.to_dict()) == m and "ring_order" not in m.to_dict()
    # the older top-level names move into ring; contradicting it is an error naming both
    old = ModelConfig(**TINY, ring_order="flat", attention_impl="xla")
    assert old.ring == RingOptions(ring_order="flat", impl="xla") and old.ring_order is None
    assert old.replace(ring_order="hierarchical").ring == RingOptions(impl="xla")
    assert ModelConfig(**TINY, ring={"impl": "xla"}, ring_order="flat").ring == RingOptions(ring_order="flat", impl="xla")
    with pytest.raises(ValueError, match="ring_order='flat' and ring.ring_order='hierarchical' disagree"):
        ModelConfig(**TINY, ring={"ring_order": "hierarchical"}, ring_order="flat")
    with pytest.raises(ValueError, match="attention_impl: unknown impl 'cuda'"):
        ModelConfig(**TINY, attention_impl="cuda")
    with pytest.raises(ValueError, match="ring.kv_exchange: unknown kv_exchange 'some'"):
        ModelConfig(**TINY, ring={"kv_exchange": "some"})


def test_yaml_keys_reach_the_model_config():
    """``model.ring.<field>`` overrides (the README's keys) and the older ``model.ring_order`` load."""
    over = ["model.ring.backward_ring=query", "model.ring.kv_exchange=sparse", "model.ring.exchange_capacity=0.5",
            "model.ring.fuse_forward=false", "model.ring.fuse_backward=false", "model.ring.impl=xla",
            "model.ring.ring_order=flat"]
    cfg = load_config(CONFIG, over)
    _, m = build_model_config(cfg.model, cfg.config_dir)
    assert m.ring == RingOptions(ring_order="flat", backward_ring="query", kv_exchange="sparse", exchange_capacity=0.5,
                                 fuse_forward=False, fuse_backward=False, impl="xla")
    cfg = load_config(CONFIG, ["model.ring_order=flat"])
    assert build_model_config(cfg.model, cfg.config_dir)[1].ring.ring_order == "flat"
    for bad, match in [("model.ring.backward_ring=kq", "ring.backward_ring: unknown backward_ring 'kq'"),
                       ("model.ring.exchange=sparse", r"unknown config key\(s\) model.ring.exchange; model.ring accepts")]:
        cfg = load_config(CONFIG, [bad])
        with pytest.raises(ValueError, match=match):
            build_model_config(cfg.model, cfg.config_dir)


def test_cli_accepts_ring_keys(capsys):
    from mtraining_jax.train import cli

    assert cli.main(["--config", CONFIG, "model.ring.backward_ring=query", "model.ring.kv_exchange=sparse",
                     "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "backward_ring: query" in out and "kv_exchange: sparse" in out


@pytest.mark.parametrize("mode", ["--print-config", "--plan"])
def test_cli_bad_ring_option_is_one_line_naming_the_dotted_key(capsys, mode):
    """A bad ``model.ring.<field>`` (or the older ``model.ring_order``) is one line on stderr naming
    the full dotted key and the value, status 2, with ``--plan`` and ``--print-config`` alike."""
    from mtraining_jax.train import cli

    for bad, want in [("model.ring.backward_ring=sideways", "model.ring.backward_ring: unknown backward_ring 'sideways'"),
                      ("model.ring.kv_exchange=3", "model.ring.kv_exchange: unknown kv_exchange 3;"),
                      ("model.ring.fuse_forward=maybe", "model.ring.fuse_forward must be a bool, got 'maybe'"),
                      ("model.ring.exchange_capacity=2.5", "model.ring.exchange_capacity as a fraction must be in (0, 1], "
                                                           "got 2.5"),
                      ("model.ring.no_such=1", "unknown config key(s) model.ring.no_such; model.ring accepts ["),
                      ("model.ring=flat", "model.ring must be a mapping of ring options"),
                      ("model.ring_order=spiral", "model.ring_order: unknown ring order 'spiral'")]:
        assert cli.main(["--config", CONFIG, bad, mode]) == 2, bad
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert "\n" not in err and err.startswith("mtraining-train: error: ") and want in err, (bad, err)
        assert mode == "--plan" or not captured.out


def test_ring_options_merge_key_by_key(tmp_path):
    """``model.ring`` (and ``sparsity``) of a training YAML merge key by key into the model YAML's
    (``model.path``), and a ``model.ring.<field>`` override into both."""
    (tmp_path / "base.yaml").write_text(
        "vocab_size: 8\nhidden_size: 64\nintermediate_size: 8\nnum_layers: 2\nnum_heads: 2\nnum_kv_heads: 1\n"
        "ring: {ring_order: flat, fuse_forward: false}\nsparsity: {vertical_p: 0.8, slash_max: 4}\n")
    (tmp_path / "train.yaml").write_text("model:\n  path: base.yaml\n  ring: {backward_ring: query}\n"
                                         "  sparsity: {slash_p: 0.7}\n")
    (tmp_path / "inline.yaml").write_text("model:\n  path: base.yaml\n  ring: {ring_order: hierarchical}\n")
    cfg = load_config(str(tmp_path / "train.yaml"), ["model.ring.impl=xla"])
    m = build_model_config(cfg.model, cfg.config_dir)[1]
    assert m.ring == RingOptions(ring_order="flat", fuse_forward=False, backward_ring="query", impl="xla")
    assert m.sparsity == {"vertical_p": 0.8, "slash_max": 4, "slash_p": 0.7}
    cfg = load_config(str(tmp_path / "inline.yaml"), ["model.ring.impl=xla"])
    assert cfg.model.fields["ring"] == {"ring_order": "hierarchical", "impl": "xla"}
    assert build_model_config(cfg.model, cfg.config_dir)[1].ring == RingOptions(fuse_forward=False, impl="xla")


# ----------------------------------------------------------------------------- dispatch, index sources

def test_dispatch_refuses_keywords_a_backend_does_not_take():
    q = jnp.zeros((1, 64, 2, 32), jnp.float32)
    k = v = q[:, :, :1]
    pos = jnp.arange(64)
    attention(q, k, v, pos, backend="reference", mesh=None)  # mesh: taken by every backend
    for kw, name in [(dict(ring=RingOptions()), "ring"), (dict(mtraining=MTrainingConfig()), "mtraining"),
                     (dict(msa_warmup=True), "msa_warmup"), (dict(msa=MSAConfig()), "msa")]:
        with pytest.raises(ValueError, match=f"the 'reference' attention backend does not take {name}"):
            attention(q, k, v, pos, backend="reference", **kw)
    with pytest.raises(ValueError, match="the 'ring' attention backend does not take mtraining"):
        attention(q, k, v, pos, backend="ring", mtraining=MTrainingConfig())
    with pytest.raises(ValueError, match="'mtraining' attention backend does not take msa_index"):
        attention(q, k, v, pos, backend="mtraining", msa_index=(q, k))
    with pytest.raises(TypeError):
        attention(q, k, v, pos, backend="ring", ring_order="flat")  # the ring options travel as ring=
    from mtraining_jax.mesh import make_mesh

    mesh = make_mesh((1, 2), jax.devices()[:2])
    with pytest.raises(ValueError, match=r"differs from mtraining.ring=.*pass the ring options in one place"):
        attention(q, k, v, pos, backend="mtraining", mesh=mesh, ring=RingOptions(ring_order="flat"),
                  mtraining=MTrainingConfig())


def test_index_source_protocols():
    from mtraining_jax.layouts import Layout
    from mtraining_jax.sparsity.convert import RankStepIndex
    from mtraining_jax.sparsity.index import full_index
    from pallas_kernels.index_format import full_step_index

    lay = Layout("block_striped", 512, 4, stripe=64)
    src = RankStepIndex(full_index(1, 2, 512, 64), jnp.int32(0), lay, 2, 2)
    assert isinstance(src, IndexSource) and isinstance(src, FusedIndexSource) and isinstance(src, GlobalIndexSource)
    idx = full_step_index(1, 2, 64, 64, jnp.arange(64), jnp.arange(64), 64)
    stacked = StackedStepIndex(jax.tree.map(lambda a: jnp.stack([jnp.stack([a] * 4)] * 4), idx), 0)
    assert isinstance(stacked, GlobalIndexSource) and not isinstance(stacked, FusedIndexSource)
    assert not isinstance(idx, IndexSource) and not isinstance(None, IndexSource)


def _record_ring_configs(monkeypatch) -> list:
    """The resolved :class:`RingConfig` of every ring call traced from now on."""
    calls = []
    real = ring_attention_mod.RingConfig

    def recording(*a, **kw):
        calls.append(real(*a, **kw))
        return calls[-1]

    monkeypatch.setattr(ring_attention_mod, "RingConfig", recording)
    return calls


def test_msa_ring_options_and_its_per_rank_selection(monkeypatch):
    """MSA passes its ring options to the sparse ring (before issue 38 it took only the order and the
    impl). Its selection covers each rank's own queries, so ``auto`` must take the K/V-side backward
    even for multi-head attention (where bytes favour the query side, which converted other ranks'
    steps from this rank's selection: wrong gradients), and the query side and the sparse exchange
    are refused. Output and gradients on 2 ranks equal one device's."""
    from mtraining_jax.attention.msa import msa_attention
    from mtraining_jax.layouts import Layout
    from mtraining_jax.mesh import make_mesh

    for key, value in (("backward_ring", "query"), ("kv_exchange", "sparse")):
        with pytest.raises(ValueError, match=f"msa ring.{key}='{value}' needs every rank's index"):
            MSAConfig(ring={key: value})
    B, S, H, D, DI = 1, 512, 2, 32, 16  # multi-head: Hq == Hkv
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    shapes = [(B, S, H, D), (B, S, H, D), (B, S, H, D), (B, S, H, DI), (B, S, DI), (B, S, H, D)]
    q, k, v, qi, ki, do = (jax.random.normal(key, sh, jnp.float32) for key, sh in zip(ks, shapes))

    def run(mesh, cfg, lay=None):
        p = (lambda x: x) if lay is None else lay.permute
        f = lambda q, k, v: jnp.sum(msa_attention(q, k, v, p(qi), p(ki), mesh, cfg, metrics=False)[0] * p(do))  # noqa: E731
        loss, g = jax.jit(jax.value_and_grad(f, (0, 1, 2)))(p(q), p(k), p(v))
        return loss, g if lay is None else tuple(lay.unpermute(x) for x in g)

    want = run(None, MSAConfig(top_k=3, layout="contiguous", ring=RingOptions(impl="xla")))
    lay = Layout("block_striped", S, 2, stripe=64)
    mesh = make_mesh((1, 2), jax.devices()[:2])
    calls = _record_ring_configs(monkeypatch)
    for opts in (RingOptions(impl="xla"), RingOptions(fuse_forward=False, fuse_backward=False, impl="xla")):
        del calls[:]
        loss, g = run(mesh, MSAConfig(top_k=3, layout="block_striped", ring=opts), lay)
        np.testing.assert_allclose(loss, want[0], rtol=1e-5)
        for a, b in zip(g, want[1]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
        assert {(c.backward_ring, c.kv_exchange, c.fuse_forward, c.impl) for c in calls} == {
            ("kv", "ring", opts.fuse_forward, "xla")}


# ----------------------------------------------------------------------------- two training steps

SEQ = 1024
# the tiny CPU config with a dense ring layer and an MTraining sparse layer, block_striped on 1 x 2
# (compile time: a 2 x 4 mesh takes twice as long; the ops are checked on every mesh elsewhere)
TRAIN = [f"data.seq_len={SEQ}", f"model.max_position_embeddings={SEQ}", "model.attention_backend=mtraining",
         "model.dense_layers=[0]", "model.layout=block_striped", "data.layout=block_striped",
         "model.sparsity.last_q=64", "model.sparsity.vertical_max=64", "model.sparsity.slash_max=4",
         "mesh.shape=[1,2]", "optim.lr=1e-3"]
OPTIONS = {
    "backward_ring=query": ["model.ring.backward_ring=query"],
    "kv_exchange=sparse": ["model.ring.kv_exchange=sparse"],
    "no_fused_calls": ["model.ring.fuse_forward=false", "model.ring.fuse_backward=false"],
    "impl=xla": ["model.ring.impl=xla", "model.ring.kernel_stream=shared"],  # (the stream: Mosaic's; ignored here)
}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return token_file(tmp_path_factory)


def _two_steps(tokens, extra, monkeypatch=None):
    """``(losses of 2 steps, model config, RingConfigs the ring calls were traced with)``."""
    calls = [] if monkeypatch is None else _record_ring_configs(monkeypatch)
    cfg = tiny_config(tokens, *TRAIN, *extra)
    t, loader, sh = training_parts(cfg)
    _, model_cfg = build_model_config(cfg.model, cfg.config_dir)
    state = t.state_fn()
    losses = []
    for _ in range(2):
        state, m = t.train_step(state, jax.tree.map(to_global, next(loader), sh))
        losses.append(float(m["loss"]))
    return np.array(losses), model_cfg, calls


@pytest.fixture(scope="module")
def default_losses(tokens):
    losses, model_cfg, _ = _two_steps(tokens, [])
    assert model_cfg.layer_backends == ("ring", "mtraining") and model_cfg.ring == RingOptions()
    assert np.all(np.isfinite(losses))
    return losses


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_ring_option_trains_exactly(tokens, default_losses, name, monkeypatch):
    losses, model_cfg, calls = _two_steps(tokens, OPTIONS[name], monkeypatch)
    assert np.all(np.isfinite(losses))
    np.testing.assert_allclose(losses, default_losses, rtol=0, atol=1e-5)  # every option is exact
    sparse = model_cfg.attention_spec("mtraining")["mtraining"].ring
    dense = model_cfg.attention_spec("ring")["ring"]
    assert calls, "no ring call was traced"
    if name == "backward_ring=query":
        assert sparse.backward_ring == dense.backward_ring == "query"
        assert {c.backward_ring for c in calls} == {"query"}  # auto would give "kv" for GQA 2/1
    elif name == "kv_exchange=sparse":
        assert sparse.kv_exchange == "sparse" and dense.kv_exchange == "ring"
        assert {c.kv_exchange for c in calls} == {"ring", "sparse"}  # the dense layer keeps the ring
    elif name == "no_fused_calls":
        assert not (sparse.fuse_forward or sparse.fuse_backward or dense.fuse_forward or dense.fuse_backward)
        assert not any(c.fuse_forward or c.fuse_backward for c in calls)
    else:
        assert sparse.impl == dense.impl == "xla" and {c.impl for c in calls} == {"xla"}
        assert sparse.kernel_stream == dense.kernel_stream == "shared" and {c.kernel_stream for c in calls} == {"shared"}
