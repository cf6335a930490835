"""An independent reference for ``benchmarks/copy_learnability.py --induction``: a minimal 2-layer
pre-LN transformer written here in plain JAX + optax (none of the library's model, trainer or
attention), the same size as the CPU probe (d_model 128, 2 heads, 512 tokens, batch 8, AdamW with
warm-up and cosine decay), trained on the same induction windows. If it learns content-based copying
where the library's model does not, the library is at fault; if both stay at chance, it is the task's
training dynamics (the induction plateau).

    python benchmarks/induction_reference.py [ALPHABET=256] [STEPS=1000] [LR=1e-3] [rope|learned]
    IND_S=128 IND_B=32 python benchmarks/induction_reference.py 256 2000     # shorter windows, larger batch

Prints, every 100 steps, the training loss and the held-out nll on the copied tokens and on the rest
(chance: ln ALPHABET)."""
import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.copy_learnability import induction_windows  # noqa: E402
S, B = int(os.environ.get("IND_S", 512)), int(os.environ.get("IND_B", 8))  # window, batch
Dm, H, L, V = 128, 2, 2, 256


def init(key):
    ks = iter(jax.random.split(key, 64))

    def n(*shape):
        return jax.random.normal(next(ks), shape) * 0.02

    p = {"emb": n(V, Dm), "out": n(Dm, V), "pos": n(S, Dm)}
    for layer in range(L):
        p[f"l{layer}"] = {"wq": n(Dm, Dm), "wk": n(Dm, Dm), "wv": n(Dm, Dm), "wo": n(Dm, Dm),
                          "w1": n(Dm, 4 * Dm), "w2": n(4 * Dm, Dm)}
    return p


def rope(x):
    half = x.shape[-1] // 2
    f = 1.0 / (10000 ** (jnp.arange(half) / half))
    t = jnp.arange(x.shape[1])[:, None] * f[None]
    c, s = jnp.cos(t)[None, :, None], jnp.sin(t)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], -1)


def ln(x):
    return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)


def fwd(p, x, pos_kind="rope"):
    """Logits ``[B, S, V]`` of tokens ``x [B, S]``: causal softmax attention, GELU MLP, pre-LN."""
    h = p["emb"][x] + (p["pos"][None] if pos_kind == "learned" else 0)
    mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    for layer in range(L):
        w, a = p[f"l{layer}"], ln(h)
        q, k, v = [(a @ w[n]).reshape(x.shape[0], x.shape[1], H, Dm // H) for n in ("wq", "wk", "wv")]
        if pos_kind == "rope":
            q, k = rope(q), rope(k)
        s = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(Dm // H), -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(h.shape)
        h = h + o @ w["wo"]
        h = h + jax.nn.gelu(ln(h) @ w["w1"]) @ w["w2"]
    return ln(h) @ p["out"]


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="IND_S / IND_B in the environment: "
                                 "window length / batch")
    ap.add_argument("alphabet", nargs="?", type=int, default=256)
    ap.add_argument("steps", nargs="?", type=int, default=1000)
    ap.add_argument("lr", nargs="?", type=float, default=1e-3)
    ap.add_argument("pos_kind", nargs="?", choices=("rope", "learned"), default="rope")
    a = ap.parse_args(argv)
    alphabet, steps, lr, pos_kind = a.alphabet, a.steps, a.lr, a.pos_kind
    opt = optax.adamw(optax.warmup_cosine_decay_schedule(0, lr, 50, steps, lr * 0.1), weight_decay=0.1)

    def loss_fn(p, x):
        return optax.softmax_cross_entropy_with_integer_labels(fwd(p, x[:, :-1], pos_kind), x[:, 1:]).mean()

    @jax.jit
    def step(p, o, x):
        loss, g = jax.value_and_grad(loss_fn)(p, x)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    ht, hm = induction_windows(S + 1, B, np.random.default_rng(99), alphabet=alphabet)

    @jax.jit
    def held(p):
        nll = optax.softmax_cross_entropy_with_integer_labels(fwd(p, jnp.asarray(ht[:, :-1]), pos_kind),
                                                              jnp.asarray(ht[:, 1:]))
        m = jnp.asarray(hm[:, 1:])
        return (nll * m).sum() / m.sum(), (nll * ~m).sum() / (~m).sum()

    p = init(jax.random.PRNGKey(0))
    o, rng, t0 = opt.init(p), np.random.default_rng(0), time.time()
    for i in range(1, steps + 1):
        x, _ = induction_windows(S + 1, B, rng, alphabet=alphabet)
        p, o, loss = step(p, o, jnp.asarray(x))
        if i % 100 == 0:
            c, r = held(p)
            print(f"step {i} loss {float(loss):.3f} copied_nll {float(c):.3f} other_nll {float(r):.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
