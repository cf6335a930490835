"""Long-context evaluation (``mtraining-eval``): needle-in-a-haystack grids, perplexity by
position, RULER-style synthetic tasks, vertical-slash index recall, and run comparisons.

Layering: this package sits above ``mtraining_jax.train`` (it reuses the trainer's mesh, layout,
data and tokenizer code) and below ``benchmarks``. The trainer can call
:func:`mtraining_jax.eval.api.evaluate_params` from its eval hook (a lazy import).
"""
