"""Evaluations of a trained arm of the quality study beyond its protocol: the parameters read with
another attention backend in every layer (``--cross-eval``), the dense arm's parameters read with the
sparse arm's attention (``--sparse-read``), index recall / density under other sparsity budgets on
the trained q/k (``--recall-budgets``), the sparse arm's parameters read with its attention under
other settings (``--reread``) and the index's recall of the NIAH needle for the answer's rows
(``--needle-recall``); :func:`probe` runs each so that its failure is recorded, not
raised."""

from __future__ import annotations

import argparse
import dataclasses
import traceback


def probe(rec: dict, key: str, fn) -> None:
    """``rec[key] = fn()``; a failure is printed and kept as ``rec[key + "_error"]`` (the training
    record and the other probes stay)."""
    try:
        rec[key] = fn()
    except Exception as e:
        traceback.print_exc()
        rec[f"{key}_error"] = f"{type(e).__name__}: {e}"


def parse_budgets(text: str) -> list:
    """``"vertical_max=8192,slash_max=128;last_q=256"`` -> ``[{"vertical_max": 8192, ...}, {...}]``
    (``;`` between budgets, ``,`` between fields; an empty budget is the model's own)."""
    out = []
    for part in text.split(";"):
        b = {}
        for kv in filter(None, (t.strip() for t in part.split(","))):
            k, sep, v = kv.partition("=")
            if not sep:
                raise argparse.ArgumentTypeError(f"budget field {kv!r} is not NAME=VALUE")
            try:
                b[k.strip()] = float(v) if "." in v else int(v)
            except ValueError:
                raise argparse.ArgumentTypeError(f"budget field {kv!r}: {v!r} is not a number") from None
        out.append(b)
    return out


def cross_eval(model_cfg, params, tok, spec, mesh, held, backend: str, retrieval: bool = True) -> dict:
    """The trained parameters evaluated with ``backend`` attention in EVERY layer (e.g. a model
    trained with sparse attention, read with dense attention): held-out loss by position and the
    retrieval sections of ``spec`` unless ``retrieval=False``. Shows whether what the model learned
    holds without the sparse pattern (whose index is estimated from the window's last queries)."""
    cfg = dataclasses.replace(model_cfg, attention_backends=(backend,) * model_cfg.num_layers)
    res = _read(cfg, params, tok, spec, mesh, held, retrieval, f"{backend} attention in every layer")
    return {"backend": backend, "eval": res}


def sparse_read(config_path: str, overrides, params, tok, spec, mesh, held, retrieval: bool = True) -> dict:
    """Trained (dense) parameters evaluated with the attention of the model that the trainer config
    ``config_path`` with ``overrides`` builds (the MTraining arm's: sparse layers 1-11, its
    ``SparsityConfig``): the "dense training, sparse inference" cell of the MTraining paper's Table 1.
    Held-out loss by position and, unless ``retrieval=False``, the NIAH / RULER sections of ``spec``."""
    import os

    model_cfg = arm_model_config(config_path, overrides)
    res = _read(model_cfg, params, tok, spec, mesh, held, retrieval, f"{os.path.basename(config_path)}'s attention")
    return {"config": os.path.basename(config_path), "backends": list(model_cfg.layer_backends), "eval": res}


def reread(config_path: str, arm_overrides, overrides, params, tok, spec, mesh, held) -> dict:
    """A sparse-trained arm's parameters read with its own attention (``config_path`` + ``arm_overrides``)
    changed by ``overrides`` (one ``--reread``, e.g. a denser index: ``model.sparsity.last_q=1024``): held-out
    loss by position, the NIAH / RULER sections of ``spec`` and the index recall / density at ``spec.recall_ps``
    of that read. Splits the sparse read's cost: the same parameters, another index."""
    model_cfg = arm_model_config(config_path, [*arm_overrides, *overrides])
    res = _read(model_cfg, params, tok, spec, mesh, held, True, f"its attention with {' '.join(overrides)}",
                recall=True)
    return {"overrides": list(overrides), "backends": list(model_cfg.layer_backends), "eval": res}


def arm_model_config(config_path: str, overrides):
    """The model config that the trainer config ``config_path`` with ``overrides`` builds (another arm's)."""
    from mtraining_jax.train.config import load_config
    from mtraining_jax.train.state import build_model_config

    cfg = load_config(config_path, list(overrides))
    return build_model_config(cfg.model, cfg.config_dir)[1]


def needle_probe(model_cfg, params, tok, spec, mesh, held, layers=None, p: float = 0.9) -> dict:
    """:func:`mtraining_jax.eval.recall.needle_recall` on the longest length of the NIAH grid of ``spec`` (its
    haystack, its seed, every depth and sample: the same passkeys, paired with the grid's outcomes; one batch,
    one compilation): how much of the answer's attention to the needle the index keeps, over ``layers`` (the
    sparse arm's sparse layers)."""
    from mtraining_jax.eval.recall import needle_recall

    stream = held if spec.haystack == "heldout" else None
    out = needle_recall(model_cfg, params, tok, spec.lengths[-1:], spec.depths, spec.samples, spec.seed, stream,
                        mesh, p, layers)
    print(f"  needle recall p={p:g}: the index keeps {out['mean_kept']:.3f} of the answer's attention to the needle "
          f"(layers {out['layers'][0]}-{out['layers'][-1]})", flush=True)
    return out


def _read(cfg, params, tok, spec, mesh, held, retrieval: bool, what: str, recall: bool = False) -> dict:
    from mtraining_jax.eval.api import evaluate_params

    params = _params_of(cfg, params)  # an MSA model's index branch has no use (and no place) in another read
    spec = dataclasses.replace(spec, ppl_len=spec.perplexity_len, **({} if recall else {"recall_ps": ()}),
                               **({} if retrieval else {"lengths": ()}))
    res = evaluate_params(cfg, params, tok, spec, mesh=mesh, heldout=held, label=f"as {what}", progress=False)
    rec = res.get("recall") or {}
    print(f"  read with {what}: held-out loss {res['perplexity']['mean_loss']:.4f}"
          + (f", NIAH {_mean(res['niah']['accuracy']):.3f}" if "niah" in res else "")
          + "".join(f", recall p={p} {v:.3f} (density {rec['mean_density'][p]:.3f}"
                    + (f"; on the window's rows {rec['mean_window_recall'][p]:.3f}" if p in (rec.get(
                        "mean_window_recall") or {}) else "")
                    + (f"; caps bind (vertical / slash) {rec['mean_vertical_capped'][p]:.2f} / "
                       f"{rec['mean_slash_capped'][p]:.2f}, uncapped it asks for "
                       f"{rec['mean_vertical_needed'][p]:.0f} / {rec['mean_slash_needed'][p]:.1f}"
                       if p in (rec.get("mean_vertical_capped") or {}) else "")
                    + ")"
                    for p, v in (rec.get("mean_recall") or {}).items()), flush=True)
    return res


def _mean(grid) -> float:
    xs = [x for row in grid for x in row]
    return sum(xs) / len(xs)


def _params_of(cfg, params) -> dict:
    """``params`` restricted to the parameters a model of ``cfg`` has (the tree of its abstract init)."""
    from flax import nnx

    from mtraining_jax.model.qwen2 import Qwen2ForCausalLM
    from mtraining_jax.train.state import split_model

    tmpl = split_model(Qwen2ForCausalLM, cfg, 0)[0].param_template
    tmpl = nnx.to_pure_dict(tmpl) if hasattr(nnx, "to_pure_dict") else tmpl.to_pure_dict()

    def keep(p, t):
        if not isinstance(t, dict):
            return p
        missing = [k for k in t if k not in p]
        if missing:
            raise ValueError(f"cross_eval: the trained parameters lack {missing} of a {cfg.layer_backends} model")
        return {k: keep(p[k], t[k]) for k in t}

    return keep(params, tmpl)


def budget_sweep(model_cfg, params, window, mesh, budgets, rows: int, p: float = 0.9) -> list:
    """Index recall / density at top-p ``p`` under each budget (SparsityConfig overrides) on the
    trained model's q/k of one held-out ``window [1, S]`` (q/k captured once); each entry also has the
    recall on the estimate's own window and which cap binds (``mean_window_recall``, ``mean_vertical_capped``,
    ``mean_slash_capped``, ``mean_vertical_needed``, ``mean_slash_needed`` and their ``layer_`` means:
    :func:`mtraining_jax.eval.recall.index_recall`)."""
    from mtraining_jax.eval.recall import index_recall, layer_qk

    qs, ks, _ = layer_qk(model_cfg, params, window, mesh)
    out = []
    key = f"{p:g}"
    for b in budgets:
        r = index_recall(model_cfg, None, None, (p,), num_rows=rows, qk=(qs, ks), budgets=b)
        row = {"budget": b, "p": p, "mean_recall": r["mean_recall"][key], "min_recall": r["min_recall"][key],
               "mean_density": r["mean_density"][key],
               "layer_recall": [float(sum(h) / len(h)) for h in r["recall"][key]],
               "layer_density": [float(sum(h) / len(h)) for h in r["density"][key]]}
        for name in ("window_recall", "vertical_capped", "slash_capped", "vertical_needed", "slash_needed"):
            if name in r:
                row["mean_" + name] = r["mean_" + name][key]
                row["layer_" + name] = [float(sum(h) / len(h)) for h in r[name][key]]
        out.append(row)
        caps = (f" window {row['mean_window_recall']:.3f}" if "mean_window_recall" in row else "") + (
            f"; capped heads: vertical {row['mean_vertical_capped']:.2f}, slash {row['mean_slash_capped']:.2f}")
        print(f"  recall p={p:g} {b or 'model budgets'}: mean {row['mean_recall']:.3f} "
              f"min {row['min_recall']:.3f} density {row['mean_density']:.3f}{caps}", flush=True)
    return out
