"""Training stack: config, data, chunked loss, optimizer, checkpoints, metrics, loop, CLI.

Modules: ``config`` (frozen dataclasses + YAML + dotted overrides), ``tokenizer``, ``data``
(packed sequences in layout order, stdlib corpus, passkey), ``loss`` (chunked cross-entropy),
``optim`` (AdamW + warmup/cosine), ``state`` (model split/bind, train state), ``step`` (jitted
train/eval steps), ``checkpoint`` (orbax), ``metrics`` (JSONL/TensorBoard/tqdm/plot),
``distributed`` (multi-process init), ``loop`` (``run``), ``cli`` (``mtraining-train``).
Import the submodules directly; this package keeps its import light (no JAX backend start).
"""
