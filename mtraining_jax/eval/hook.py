"""The trainer's long-context evaluation (``eval.long_context`` of the training config).

:class:`LongContextHook` is a training-loop hook (:mod:`mtraining_jax.train.loop`): every
``every`` steps and at the last step it scores the current parameters
(:func:`mtraining_jax.eval.api.evaluate_params`: NIAH grid and RULER-style tasks, filler haystack,
the run's mesh and attention backends) and logs as ``split="eval"``: ``long/niah_accuracy``,
``long/niah_accuracy@<L>`` (several lengths only), ``long/<task>_accuracy``, each with its
``..._token_accuracy`` twin. The examples are seeded by the run's ``seed``: the same at every
evaluation.
"""

from __future__ import annotations

import numpy as np

from mtraining_jax.eval.api import EvalSpec, check_spec, evaluate_params
from mtraining_jax.eval.predictor import ModelPredictor
from mtraining_jax.mesh import num_cp_ranks


class LongContextHook:
    """Built from the run's config before training starts: every length is checked against the
    model's RoPE range and the sequence layout on ``mesh`` (``ValueError`` naming the key)."""

    def __init__(self, cfg, model_cfg, mesh, tokenizer):
        lc = cfg.eval.long_context
        self.every, self.tokenizer = lc.every, tokenizer
        try:
            self.spec = EvalSpec(lengths=lc.lengths or (cfg.data.seq_len,), depths=lc.depths, samples=lc.samples,
                                 ruler_tasks=lc.tasks, ruler_samples=lc.task_samples, ppl_windows=0,
                                 recall_ps=(), batch_size=lc.batch_size, seed=cfg.seed)
            check_spec(model_cfg, self.spec, num_cp_ranks(mesh))
        except ValueError as e:
            raise ValueError(f"eval.long_context: {e}") from None
        self.predictor = None  # a ModelPredictor from the first evaluation on (its compilations reused)

    def __call__(self, run, step: int, metrics: dict) -> None:
        if step % self.every and step != run.stop:
            return
        params = run.state["params"]
        if self.predictor is None:
            self.predictor = ModelPredictor(run.model_cfg, params, run.mesh)
        else:
            self.predictor.set_params(params)
        res = evaluate_params(run.model_cfg, params, self.tokenizer, self.spec, mesh=run.mesh, progress=False,
                              predictor=self.predictor)
        rec = self.summary(res)
        run.writer.write(step, rec, split="eval")
        if run.eval_metrics and run.eval_metrics[-1]["step"] == step:
            run.eval_metrics[-1].update(rec)
        else:
            run.eval_metrics.append({"step": step, **rec})
        run.bar.write(f"long-context eval step {step} ({res['seconds']:.1f}s): "
                      + ", ".join(f"{k}={v:.3f}" for k, v in rec.items()))

    @staticmethod
    def summary(res: dict) -> dict:
        """Flat metrics of an :func:`evaluate_params` result (module docstring)."""
        rec = {}
        if "niah" in res:
            acc = np.asarray(res["niah"]["accuracy"], np.float64)  # [depths, lengths]
            rec["long/niah_accuracy"] = float(acc.mean())
            rec["long/niah_token_accuracy"] = float(np.mean(res["niah"]["token_accuracy"]))
            if acc.shape[1] > 1:
                rec.update({f"long/niah_accuracy@{n}": float(a) for n, a in zip(res["niah"]["lengths"], acc.mean(0))})
        for task, r in res.get("ruler", {}).get("tasks", {}).items():
            rec[f"long/{task}_accuracy"] = float(np.mean(r["accuracy"]))
            rec[f"long/{task}_token_accuracy"] = float(np.mean(r["token_accuracy"]))
        return rec
