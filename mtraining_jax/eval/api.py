"""One evaluation of a model: what to measure (:class:`EvalSpec`) and :func:`evaluate_params`,
which the CLI, the quality study and a trainer's eval hook call.

Output (``out_dir`` given): ``results.json`` (rewritten after every section, so a crash keeps what
was measured) and the PNGs ``niah.png``, ``position_loss.png``, ``ruler.png``, ``recall.png``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional, Sequence

from mtraining_jax.eval.checkpoints import check_context
from mtraining_jax.eval.predictor import ModelPredictor, layout_for
from mtraining_jax.eval.retrieval import niah_grid, ruler_suite
from mtraining_jax.eval.tasks import TASKS
from mtraining_jax.model.config import ModelConfig

RESULTS = "results.json"


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What to evaluate. Empty ``lengths`` / zero counts switch a section off.

    ``lengths``: context lengths (tokens) of the NIAH grid and RULER tasks; ``depths``: needle depths
    in ``[0, 1]``; ``samples``: examples per NIAH cell; ``ruler_tasks`` / ``ruler_samples``: RULER-style
    tasks and examples per (task, length); ``ppl_len`` (default: the largest length) /
    ``ppl_windows`` / ``ppl_buckets``: loss by position; ``recall_ps``: top-p values of the index-recall
    measurement (on ``recall_rows`` sampled query rows of one held-out window of ``ppl_len``);
    ``haystack``: ``filler`` (repeated sentences) or ``heldout`` (held-out text/code);
    ``batch_size``: sequences per forward pass; ``seed``: task generation.
    """

    lengths: Sequence[int] = (1024, 2048)
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0)
    samples: int = 4
    ruler_tasks: Sequence[str] = ("multikey", "multivalue", "vartrack")
    ruler_samples: int = 4
    ppl_len: Optional[int] = None
    ppl_windows: int = 4
    ppl_buckets: int = 16
    recall_ps: Sequence[float] = (0.9, 0.5)
    recall_rows: int = 512
    haystack: str = "filler"
    batch_size: int = 1
    seed: int = 0

    def __post_init__(self):
        bad = [t for t in self.ruler_tasks if t not in TASKS]
        if bad:
            raise ValueError(f"unknown RULER-style task(s) {bad}; expected some of {TASKS}")
        bad = [d for d in self.depths if not 0.0 <= float(d) <= 1.0]
        if bad:
            raise ValueError(f"needle depths must lie in [0, 1], got {bad}")
        bad = [n for n in self.lengths if int(n) < 1]
        if bad:
            raise ValueError(f"context lengths must be positive, got {bad}")
        bad = [p for p in self.recall_ps if not 0.0 < float(p) <= 1.0]
        if bad:
            raise ValueError(f"recall top-p values must lie in (0, 1], got {bad}")
        if self.haystack not in ("filler", "heldout"):
            raise ValueError(f"haystack must be 'filler' or 'heldout', got {self.haystack!r}")
        for k in ("samples", "ruler_samples", "ppl_windows", "recall_rows"):
            if getattr(self, k) < 0:
                raise ValueError(f"{k} must be >= 0, got {getattr(self, k)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    @property
    def perplexity_len(self) -> Optional[int]:
        return self.ppl_len or (max(self.lengths) if self.lengths else None)


def check_spec(cfg: ModelConfig, spec: EvalSpec, num_ranks: int) -> None:
    """Every length must fit the model's RoPE range and the layout/sparse-block constraints
    (``ValueError`` naming the length), checked before any model runs."""
    lens = set(int(n) for n in spec.lengths)
    if spec.perplexity_len:
        lens.add(int(spec.perplexity_len))
    for n in sorted(lens):
        check_context(cfg, n)
        layout_for(cfg, n, num_ranks)


def _write(results: dict, out_dir: Optional[str]) -> None:
    if out_dir:
        tmp = os.path.join(out_dir, RESULTS + ".tmp")
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)
        os.replace(tmp, os.path.join(out_dir, RESULTS))


def evaluate_params(cfg: ModelConfig, params, tokenizer, spec: EvalSpec, *, mesh=None, heldout=None,
                    out_dir: Optional[str] = None, label: str = "", progress: bool = True,
                    predictor=None) -> dict:
    """Run every section of ``spec`` on the model ``(cfg, params)``; returns the results dict
    ``{"label", "model", "niah", "ruler", "perplexity", "recall", "seconds"}`` (absent sections
    omitted). ``heldout``: a 1-D token stream (perplexity, recall, ``haystack=heldout``);
    ``predictor``: replaces the model's (tests). Writes ``out_dir`` files when given."""
    from tqdm.auto import tqdm

    from mtraining_jax.mesh import num_cp_ranks

    check_spec(cfg, spec, 1 if mesh is None else num_cp_ranks(mesh))
    S_ppl = spec.perplexity_len
    if heldout is None and (spec.haystack == "heldout" or (S_ppl and (spec.ppl_windows or spec.recall_ps))):
        raise ValueError("perplexity, recall and haystack=heldout need held-out data (got heldout=None)")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    predict = predictor or ModelPredictor(cfg, params, mesh)
    stream = heldout if spec.haystack == "heldout" else None
    res = {"label": label, "model": {"name": cfg.name, "params": cfg.num_params(),
                                     "backends": list(cfg.layer_backends)},
           "spec": {k: (list(v) if isinstance(v, (tuple, list)) else v) for k, v in dataclasses.asdict(spec).items()}}
    t0 = time.time()
    n_niah = len(spec.lengths) * len(spec.depths) * spec.samples
    n_ruler = len(spec.lengths) * len(spec.ruler_tasks) * spec.ruler_samples
    bar = tqdm(total=n_niah + n_ruler + (spec.ppl_windows if S_ppl else 0), desc=f"eval {label}".strip(),
               unit="seq", disable=not progress)
    try:
        if n_niah:
            res["niah"] = niah_grid(predict, tokenizer, spec.lengths, spec.depths, spec.samples, spec.seed,
                                    stream, spec.batch_size, bar)
            _write(res, out_dir)
        if n_ruler:
            res["ruler"] = ruler_suite(predict, tokenizer, spec.lengths, spec.ruler_tasks, spec.ruler_samples,
                                       spec.seed, stream, spec.batch_size, bar)
            _write(res, out_dir)
        if S_ppl and spec.ppl_windows:
            from mtraining_jax.eval.perplexity import position_loss

            res["perplexity"] = position_loss(predict, heldout, S_ppl, spec.ppl_windows, spec.ppl_buckets,
                                              spec.batch_size, bar)
            _write(res, out_dir)
    finally:
        bar.close()
    if S_ppl and spec.recall_ps and predictor is None:
        from mtraining_jax.eval.recall import index_recall

        window = heldout[None, :S_ppl]
        res["recall"] = index_recall(cfg, params, window, spec.recall_ps, mesh, spec.recall_rows)
    res["seconds"] = time.time() - t0
    _write(res, out_dir)
    if out_dir:
        write_plots(res, out_dir)
    return res


def write_plots(res: dict, out_dir: str) -> list[str]:
    """The single-run PNGs of ``res`` in ``out_dir``."""
    from mtraining_jax.eval import plots

    label = res.get("label") or "model"
    out = []
    if "niah" in res:
        out.append(plots.niah_heatmaps([(label, res["niah"])], os.path.join(out_dir, "niah.png")))
    if "perplexity" in res:
        out.append(plots.position_curves([(label, res["perplexity"])], os.path.join(out_dir, "position_loss.png")))
    if "ruler" in res:
        out.append(plots.ruler_bars([(label, res["ruler"])], os.path.join(out_dir, "ruler.png")))
    if "recall" in res:
        out.append(plots.recall_maps([(label, res["recall"])], os.path.join(out_dir, "recall.png"),
                                     f"{res['recall']['p'][0]:g}"))
    return out
