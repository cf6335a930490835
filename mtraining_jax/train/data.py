"""Data: token streams, packed fixed-length sequences in layout order, synthetic passkey retrieval.

A *stream* is a 1-D array of token ids (documents joined by ``eos``). :class:`PackedLoader` cuts
it into windows of ``S + 1`` tokens (window ``w`` = ``stream[w*S : w*S + S + 1]``), visits them in
a seeded random order per epoch and emits :class:`Batch` es: ``inputs = window[:S]``, ``labels =
window[1:]`` (shifted in natural order, BEFORE the layout permutation), both then permuted with
the layout (``Layout.perm``), and ``positions = perm``.

``pack="documents"``: token ``t`` of a window gets the segment id ``#eos among window[:t]``, the
labels of ``eos`` inputs are masked out, and ``segment_ids`` travel through the layout
permutation; ``positions="per_document"`` adds ``rope_positions`` restarting at 0 per document.
``Batch.positions`` stays the global position (causal mask).

The loader state ``{"epoch", "index", "seed"}`` is checkpointed with the model; everything is
deterministic given the seed. Sources: token files (``.npy`` or raw binary, memory-mapped),
``.txt`` / ``.jsonl`` text through a tokenizer, the Python standard library's source files (split
into train / held-out by a hash of the path), passkey retrieval.
"""

from __future__ import annotations

import json
import os
import sysconfig
import zlib
from typing import NamedTuple, Optional

import numpy as np

from mtraining_jax.layouts import Layout
from mtraining_jax.train.tokenizer import ByteTokenizer


class Batch(NamedTuple):
    """One (micro-)batch in layout order.

    ``tokens, labels``: int32 ``[..., B, S]``; ``mask``: float32 ``[..., B, S]`` (1 where the label
    counts in the loss); ``positions``: int32 ``[S]`` global position of each laid token.
    ``segment_ids``: int32 ``[..., B, S]`` document of each laid token (``None``: one stream, no
    document mask); ``rope_positions``: int32 ``[..., B, S]`` RoPE position of each laid token
    (``None``: ``positions``).
    """

    tokens: np.ndarray
    labels: np.ndarray
    mask: np.ndarray
    positions: np.ndarray
    segment_ids: Optional[np.ndarray] = None
    rope_positions: Optional[np.ndarray] = None

    def reshape(self, shape) -> "Batch":
        """The per-token fields reshaped to ``shape`` (``positions`` is shared: unchanged)."""
        r = lambda a: None if a is None else a.reshape(shape)  # noqa: E731
        return Batch(r(self.tokens), r(self.labels), r(self.mask), self.positions, r(self.segment_ids),
                     r(self.rope_positions))


# ----------------------------------------------------------------------------------- streams


def _pack_documents(docs, eos_id: int) -> np.ndarray:
    """Join documents with ``eos`` into one stream (uint16 when the ids fit, else int32)."""
    docs = [np.asarray(d) for d in docs]
    if not docs:
        return np.zeros((0,), np.int32)
    top = max([int(d.max()) for d in docs if d.size] + [eos_id])
    dt = np.uint16 if top < 2**16 else np.int32
    out = np.empty(sum(d.size + 1 for d in docs), dt)
    i = 0
    for d in docs:
        out[i:i + d.size] = d
        out[i + d.size] = eos_id
        i += d.size + 1
    return out


def stdlib_files(root: Optional[str] = None) -> list[str]:
    """Sorted relative paths of the ``.py`` files of this Python's standard library
    (``sysconfig.get_paths()["stdlib"]``; ``site-packages`` excluded)."""
    root = root or sysconfig.get_paths()["stdlib"]
    rel = []
    for d, subdirs, files in os.walk(root):
        subdirs[:] = [s for s in subdirs if s not in ("site-packages", "dist-packages", "__pycache__")]
        rel += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py")]
    return sorted(rel)


def is_heldout(name: str, heldout_percent: float) -> bool:
    """Deterministic split: a file is held out iff ``crc32(name) mod 10000 < 100 * percent``."""
    return zlib.crc32(name.encode()) % 10000 < int(round(100 * heldout_percent))


def stdlib_streams(tokenizer, heldout_percent: float = 5.0, root: Optional[str] = None):
    """``(train_stream, heldout_stream)`` of the standard library sources, files joined by eos."""
    root = root or sysconfig.get_paths()["stdlib"]
    names = stdlib_files(root)
    if not names:
        raise ValueError(f"no Python source files found under the stdlib folder {root!r}")
    train, held = [], []
    for n in names:
        with open(os.path.join(root, n), "rb") as f:
            data = f.read()
        toks = (
            np.frombuffer(data, np.uint8)  # byte tokenizer: the bytes are the ids
            if isinstance(tokenizer, ByteTokenizer)
            else tokenizer.encode(data.decode("utf-8", errors="replace"))
        )
        (held if is_heldout(n, heldout_percent) else train).append(toks)
    return _pack_documents(train, tokenizer.eos_id), _pack_documents(held, tokenizer.eos_id)


def token_file_stream(path: str, dtype: str = "uint16", key: str = "data.path") -> np.ndarray:
    """Memory-mapped 1-D token array from ``.npy`` or a raw binary file of ``dtype``. A missing
    or empty file, a non-integer ``.npy`` or a raw file whose size is not a multiple of the
    ``dtype`` size is a ``ValueError`` naming ``key`` and the file."""
    if os.path.isdir(path):
        raise ValueError(f"{key} {path!r} is a directory, not a token file")
    if not os.path.isfile(path):
        raise ValueError(f"{key} {path!r} does not exist")
    if path.endswith(".npy"):
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(f"{key} {path!r} is not a readable .npy file: {e}") from None
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{key} {path!r} holds {arr.dtype} values; token ids must be integers "
                             f"(save them as uint16/uint32/int32)")
    else:
        size, item = os.path.getsize(path), np.dtype(dtype).itemsize
        if size % item:
            raise ValueError(f"{key} {path!r} has {size} bytes, not a multiple of data.token_dtype={dtype} "
                             f"({item} bytes per token)")
        arr = np.memmap(path, dtype=np.dtype(dtype), mode="r") if size else np.zeros((0,), dtype)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.size == 0:
        raise ValueError(f"{key} {path!r} holds no tokens")
    return arr


def check_token_ids(stream: np.ndarray, vocab_size: int, key: str, chunk: int = 1 << 24) -> None:
    """``ValueError`` naming the first id outside ``[0, vocab_size)`` and its position (scanned
    in chunks, so a memory-mapped file is never loaded whole)."""
    for start in range(0, len(stream), chunk):
        part = np.asarray(stream[start:start + chunk])
        bad = (part >= vocab_size) | (part < 0) if part.dtype.kind == "i" else part >= vocab_size
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{key}: token id {int(part[i])} at position {start + i} is outside the model's "
                             f"vocabulary [0, model.vocab_size={vocab_size})")


def text_stream(path: str, tokenizer, text_key: str = "text") -> np.ndarray:
    """Tokenize a ``.txt`` file (one document) or ``.jsonl`` (one document per line, field
    ``text_key``) and join the documents with ``eos``."""
    if not os.path.isfile(path):
        raise ValueError(f"data file {path!r} does not exist")
    docs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        if path.endswith(".jsonl"):
            for i, line in enumerate(f, start=1):  # line numbers as an editor shows them
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}:{e.colno}: not valid JSON: {e.msg}") from None
                if not isinstance(rec, dict):
                    raise ValueError(f"{path}:{i}: expected a JSON object with a {text_key!r} field (data.text_key), "
                                     f"got {type(rec).__name__}")
                if text_key not in rec:
                    raise ValueError(f"{path}:{i}: JSON record has no field {text_key!r} (data.text_key); "
                                     f"it has {sorted(rec)[:8]}")
                if not isinstance(rec[text_key], str):
                    raise ValueError(f"{path}:{i}: field {text_key!r} must be a string, got "
                                     f"{type(rec[text_key]).__name__}")
                docs.append(tokenizer.encode(rec[text_key]))
        else:
            docs.append(tokenizer.encode(f.read()))
    return _pack_documents(docs, tokenizer.eos_id)


def split_tail(stream: np.ndarray, heldout_percent: float):
    """Split a stream into (train, held-out = the last ``heldout_percent`` of its tokens)."""
    n = len(stream)
    cut = n - int(n * heldout_percent / 100.0)
    return stream[:cut], stream[cut:]


# ----------------------------------------------------------------------------------- passkey

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


def passkey_example(tokenizer, seq_len: int, rng: np.random.Generator, digits: int = 5):
    """One passkey-retrieval sequence of ``seq_len + 1`` tokens, natural order.

    Filler text with the needle ``"The pass key is NNNNN. Remember it."`` at a uniformly random
    depth, ending with ``"What is the pass key? The pass key is NNNNN"``. Returns
    ``(tokens [S+1] int32, answer_len)``; the answer is the last ``answer_len`` tokens.
    """
    key = "".join(str(d) for d in rng.integers(0, 10, size=digits))
    needle = tokenizer.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
    question = tokenizer.encode(" What is the pass key? The pass key is")
    answer = tokenizer.encode(f" {key}")
    fill = tokenizer.encode(FILLER)
    room = seq_len + 1 - len(needle) - len(question) - len(answer)
    if room < 0:
        raise ValueError(f"data.seq_len={seq_len} is too short for a passkey sequence")
    filler = np.resize(fill, room)
    at = int(rng.integers(0, room + 1))
    seq = np.concatenate([filler[:at], needle, filler[at:], question, answer]).astype(np.int32)
    return seq, len(answer)


def passkey_batch(tokenizer, seq_len: int, batch_size: int, rng, layout: Optional[Layout],
                  digits: int = 5, answer_only: bool = True) -> Batch:
    """A :class:`Batch` of passkey sequences; ``mask`` selects only the answer tokens when
    ``answer_only`` (passkey accuracy = answer-token accuracy), else every token."""
    toks, labs, masks = [], [], []
    for _ in range(batch_size):
        seq, n_ans = passkey_example(tokenizer, seq_len, rng, digits)
        m = np.zeros(seq_len, np.float32)
        if answer_only:
            m[seq_len - n_ans:] = 1.0
        else:
            m[:] = 1.0
        toks.append(seq[:-1])
        labs.append(seq[1:])
        masks.append(m)
    return _to_layout(np.stack(toks), np.stack(labs), np.stack(masks), layout, seq_len)


def document_segments(inputs: np.ndarray, eos_id: int):
    """``(segment_ids, doc_positions)`` int32 ``[..., S]`` of natural-order ``inputs [..., S]``:
    segment ``#eos among inputs[..., :t]`` (an ``eos`` closes its own document) and the position
    of each token inside its segment (0 at the segment's first token)."""
    inputs = np.asarray(inputs)
    S = inputs.shape[-1]
    ends = (inputs == eos_id).astype(np.int32)
    seg = np.concatenate([np.zeros(inputs.shape[:-1] + (1,), np.int32), np.cumsum(ends, -1)[..., :-1]], -1)
    t = np.broadcast_to(np.arange(S, dtype=np.int32), inputs.shape)
    first = np.concatenate([np.ones(inputs.shape[:-1] + (1,), bool), seg[..., 1:] != seg[..., :-1]], -1)
    start = np.maximum.accumulate(np.where(first, t, 0), axis=-1)
    return seg.astype(np.int32), (t - start).astype(np.int32)


def _to_layout(tokens, labels, mask, layout: Optional[Layout], seq_len: int, segment_ids=None,
               rope_positions=None) -> Batch:
    perm = (lambda a: a) if layout is None else (lambda a: layout.permute(a, axis=-1))  # noqa: E731
    opt = lambda a: None if a is None else perm(a).astype(np.int32)  # noqa: E731
    pos = np.arange(seq_len, dtype=np.int32) if layout is None else layout.perm.astype(np.int32)
    return Batch(perm(tokens).astype(np.int32), perm(labels).astype(np.int32), perm(mask).astype(np.float32), pos,
                 opt(segment_ids), opt(rope_positions))


def single_document(batch: Batch, pack: str = "documents", positions: str = "global") -> Batch:
    """``batch`` (one document per sequence, ``[B, S]``) with the fields of ``pack="documents"``
    (segment 0 everywhere; ``rope_positions = positions`` when ``per_document``); unchanged for
    ``pack="stream"``."""
    if pack == "stream":
        return batch
    shape = batch.tokens.shape
    rope = np.broadcast_to(batch.positions, shape).astype(np.int32) if positions == "per_document" else None
    return batch._replace(segment_ids=np.zeros(shape, np.int32), rope_positions=rope)


# ----------------------------------------------------------------------------------- loaders


class PackedLoader:
    """Seeded, resumable iterator of packed windows (see module docstring).

    ``next()`` returns a :class:`Batch` of shape ``[accum, batch, S]`` (``accum`` micro-batches
    for gradient accumulation) or ``[batch, S]`` when ``accum is None``.
    """

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, layout: Optional[Layout],
                 seed: int = 0, accum: Optional[int] = None, shuffle: bool = True,
                 pad_id: Optional[int] = None, name: str = "train", pack: str = "stream",
                 positions: str = "global", eos_id: Optional[int] = None):
        if pack not in ("stream", "documents"):
            raise ValueError(f"data.pack must be 'stream' or 'documents', got {pack!r}")
        if positions not in ("global", "per_document") or (positions == "per_document" and pack != "documents"):
            raise ValueError(f"data.positions={positions!r} is not valid with data.pack={pack!r}")
        if pack == "documents" and eos_id is None:
            raise ValueError("data.pack='documents' needs the tokenizer's eos_id (document separator), got None")
        self.pack, self.positions, self.eos_id = pack, positions, eos_id
        self.stream = stream
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.layout = layout
        self.accum = accum
        self.shuffle = shuffle
        self.pad_id = pad_id
        self.num_windows = max((len(stream) - 1) // self.seq_len, 0)
        need = self.batch_size * (accum or 1)
        if self.num_windows < need:
            raise ValueError(
                f"the {name} data has {len(stream)} tokens = {self.num_windows} windows of "
                f"data.seq_len={self.seq_len} + 1, fewer than one batch of {need} sequences"
            )
        self.seed, self.epoch, self.index = int(seed), 0, 0
        self._order_epoch, self._order = None, None

    # -- state -------------------------------------------------------------------------
    def get_state(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "index": self.index}

    def set_state(self, state: dict) -> None:
        for k in ("seed", "epoch", "index"):
            if k not in state:
                raise ValueError(f"data iterator state lacks {k!r}: {state!r}")
        self.seed, self.epoch, self.index = int(state["seed"]), int(state["epoch"]), int(state["index"])

    # -- iteration -----------------------------------------------------------------------
    def _order_for(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            else:
                self._order = np.arange(self.num_windows)
            self._order_epoch = epoch
        return self._order

    def _next_window(self) -> int:
        if self.index >= self.num_windows:
            self.epoch, self.index = self.epoch + 1, 0
        w = int(self._order_for(self.epoch)[self.index])
        self.index += 1
        return w

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        n = self.batch_size * (self.accum or 1)
        S = self.seq_len
        wins = np.stack([np.asarray(self.stream[w * S: w * S + S + 1]) for w in
                         (self._next_window() for _ in range(n))]).astype(np.int32)
        tokens, labels = wins[:, :-1], wins[:, 1:]
        mask = np.ones(labels.shape, np.float32)
        if self.pad_id is not None:
            mask = (labels != self.pad_id).astype(np.float32)
        seg = rope = None
        if self.pack == "documents":
            seg, doc_pos = document_segments(tokens, self.eos_id)
            mask = mask * (tokens != self.eos_id)  # an eos input's label is the next document's first token
            rope = doc_pos if self.positions == "per_document" else None
        b = _to_layout(tokens, labels, mask, self.layout, S, seg, rope)
        shape = (self.accum, self.batch_size, S) if self.accum is not None else (self.batch_size, S)
        return b.reshape(shape)


class PasskeyLoader:
    """Resumable iterator of passkey sequences (training source ``passkey``; all tokens count)."""

    def __init__(self, tokenizer, seq_len, batch_size, layout, seed=0, accum=None, digits=5, pack="stream",
                 positions="global"):
        self.pack, self.positions = pack, positions
        self.tokenizer, self.seq_len, self.batch_size = tokenizer, seq_len, batch_size
        self.layout, self.accum, self.digits = layout, accum, digits
        self.seed, self.index = int(seed), 0
        passkey_example(tokenizer, seq_len, np.random.default_rng(0), digits)  # validates seq_len

    def get_state(self) -> dict:
        return {"seed": self.seed, "epoch": 0, "index": self.index}

    def set_state(self, state: dict) -> None:
        self.seed, self.index = int(state["seed"]), int(state["index"])

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        rng = np.random.default_rng([self.seed, self.index])
        self.index += 1
        n = self.batch_size * (self.accum or 1)
        b = passkey_batch(self.tokenizer, self.seq_len, n, rng, self.layout, self.digits, answer_only=False)
        shape = (self.accum, self.batch_size, self.seq_len) if self.accum is not None else (n, self.seq_len)
        return single_document(b, self.pack, self.positions).reshape(shape)


def build_streams(cfg, tokenizer, vocab_size: Optional[int] = None):
    """``(train_stream, heldout_stream)`` for a :class:`~mtraining_jax.train.config.DataConfig`
    (``None, None`` for the passkey source). Token files are checked against ``vocab_size``."""
    if cfg.source == "passkey":
        return None, None
    if cfg.source == "stdlib":
        return stdlib_streams(tokenizer, cfg.heldout_percent)
    if cfg.source == "tokens":
        streams = {"data.path": token_file_stream(cfg.path, cfg.token_dtype, "data.path")}
        if cfg.eval_path:
            streams["data.eval_path"] = token_file_stream(cfg.eval_path, cfg.token_dtype, "data.eval_path")
        if vocab_size is not None:
            for key, st in streams.items():
                check_token_ids(st, vocab_size, f"{key} {getattr(cfg, key.split('.')[1])!r}")
        train = streams["data.path"]
        return (train, streams["data.eval_path"]) if cfg.eval_path else split_tail(train, cfg.heldout_percent)
    train = text_stream(cfg.path, tokenizer, cfg.text_key)
    if cfg.eval_path:
        return train, text_stream(cfg.eval_path, tokenizer, cfg.text_key)
    return split_tail(train, cfg.heldout_percent)


def build_train_loader(cfg, tokenizer, layout, train_stream, accum: Optional[int]):
    pack = dict(pack=getattr(cfg, "pack", "stream"), positions=getattr(cfg, "positions", "global"))
    if cfg.source == "passkey":
        return PasskeyLoader(tokenizer, cfg.seq_len, cfg.batch_size, layout, cfg.seed, accum, **pack)
    return PackedLoader(train_stream, cfg.seq_len, cfg.batch_size, layout, cfg.seed, accum, name="train",
                        eos_id=tokenizer.eos_id, **pack)


def heldout_batches(cfg, layout, heldout_stream, num_batches: int, eos_id: Optional[int] = None) -> list[Batch]:
    """The first ``num_batches`` held-out batches in file order (identical at every evaluation);
    packed like the training data (``cfg.pack``: ``eos_id`` separates documents)."""
    if heldout_stream is None or num_batches == 0:
        return []
    loader = PackedLoader(heldout_stream, cfg.seq_len, cfg.batch_size, layout, shuffle=False,
                          name="held-out", pack=getattr(cfg, "pack", "stream"),
                          positions=getattr(cfg, "positions", "global"), eos_id=eos_id)
    return [next(loader) for _ in range(min(num_batches, loader.num_windows // cfg.batch_size))]
