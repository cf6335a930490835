"""The quality study's training corpus (issue 37): per seed, windows of stdlib code of which a fraction
carries retrieval content in the evaluation's own formats (a RULER-style task example plus extra
key-value pairs), and the plain held-out code. Used by :mod:`benchmarks.quality_study`. Also the
content-copying windows of the study's copy pretraining (:func:`build_induction_corpus`, used by
:mod:`benchmarks.quality_pretrain` and :mod:`benchmarks.copy_learnability`)."""

from __future__ import annotations

import os

import numpy as np

TRAIN_TASKS = ("passkey", "multikey", "multivalue", "vartrack")
EXTRA_SHARE = 0.25  # at most this share of a retrieval window goes to the extra key-value pairs
KEY_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def key_names(rng, free, keys: int, length: int = 6, made_up: bool = True) -> list:
    """``keys`` distinct key names for the extra pairs: the evaluation's words in ``free`` first (in
    that order), then made-up lowercase names of ``length`` letters drawn from ``rng`` (the word list
    has 20 entries, so without them a window held at most 20 pairs whatever ``keys`` asked for).
    ``made_up=False``: the words of ``free`` only, as the corpora before commit 266c0c2 (the s8 study)
    were built; those corpora are reproduced token for token."""
    names = list(free[:keys])
    seen = set(names)
    while made_up and len(names) < keys:
        w = "".join(KEY_LETTERS[i] for i in rng.integers(0, len(KEY_LETTERS), length))
        if w not in seen:
            names.append(w)
            seen.add(w)
    return names


class _Parts(Exception):
    """Raised by the stand-in of :func:`mtraining_jax.eval.tasks.compose` with a task's parts."""


def task_parts(task: str, tok, seq_len: int, depth: float, rng, stream=None):
    """``(needles, depths, question, answer)`` that ``tasks.GENERATORS[task]`` would compose (its
    own random draws included), so the training examples use the evaluation's exact formats."""
    from unittest import mock

    from mtraining_jax.eval import tasks

    def capture(tokenizer, seq_len, needles, depths, question, answer, rng, stream=None):
        raise _Parts(list(needles), [float(d) for d in depths], question, answer)

    with mock.patch.object(tasks, "compose", capture):
        try:
            tasks.GENERATORS[task](tok, seq_len, depth, rng, stream=stream)
        except _Parts as p:
            return p.args
    raise RuntimeError(f"task {task!r} composed no example")


def with_repeats(code, share: float, rng, lengths=None):
    """``code`` (int32 [n]) with about ``share`` of it overwritten by copies of its own earlier spans
    (each ``lengths[0]``-``lengths[1]`` tokens, default 32-256 capped at 1/32-1/8 of ``code``, copied
    to a random later place): text a model can only predict by copying from its context, as
    repeated code and quotes are in real corpora, so copying is learned before the retrieval
    questions need it."""
    out = np.array(code, np.int32, copy=True)
    n = len(out)
    lo, hi = lengths or (min(32, n // 32), min(256, n // 8))
    if share <= 0 or lo < 1 or n < 4 * hi:
        return out
    done = 0
    while done < share * n:
        L = int(rng.integers(lo, hi + 1))
        src = int(rng.integers(0, n - 2 * L))
        dst = int(rng.integers(src + L, n - L + 1))
        out[dst:dst + L] = out[src:src + L]
        done += L
    return out


def retrieval_window(tok, n: int, task: str, rng, stream, keys: int, share: float = EXTRA_SHARE,
                     made_up_keys: bool = True):
    """``(tokens int32 [n], pairs)``: ``n`` tokens of ``stream`` (this window's code) with one
    ``task`` example (its question and answer at the end) and up to ``keys`` extra key-value pairs
    (needle at a random depth, its question and answer at a random later depth; keys distinct from
    the task's words, :func:`key_names` with ``made_up=made_up_keys``), at most ``share`` of the window;
    ``pairs`` = the extra pairs that fit."""
    from mtraining_jax.eval import tasks

    if keys <= 0:
        return tasks.GENERATORS[task](tok, n - 1, float(rng.uniform()), rng, stream=stream).tokens, 0
    needles, depths, question, answer = task_parts(task, tok, n - 1, float(rng.uniform()), rng, stream)
    used_text = " ".join(needles) + question
    free = [w for w in tasks.WORDS if w not in used_text]
    free = [free[i] for i in rng.permutation(len(free))]
    task_cost = sum(len(tok.encode(f" {x} ")) for x in needles) + len(tok.encode(question + answer))
    # the extra pairs take at most `share` of the window and never the task's own room
    budget, used, pairs = min(int(share * n), n - 1 - task_cost), 0, 0
    for w in key_names(rng, free, keys, made_up=made_up_keys):
        num = str(int(rng.integers(10 ** 5, 10 ** 6)))
        needle = f"The special magic number for {w} is: {num}."
        qa = f"What is the special magic number for {w}? The special magic number for {w} is: {num}."
        cost = len(tok.encode(f" {needle} ")) + len(tok.encode(f" {qa} "))
        if used + cost > budget:
            break
        d1 = float(rng.uniform())
        needles += [needle, qa]
        depths += [d1, float(rng.uniform(d1, 1.0))]  # the question after its needle (stable order on ties)
        used, pairs = used + cost, pairs + 1
    return tasks.compose(tok, n - 1, needles, depths, question, answer, rng, stream).tokens, pairs


def _save_atomic(path: str, arr) -> None:
    """``np.save`` to a temporary name, then rename: readers see the old file or the whole new one."""
    tmp = f"{path}.{os.getpid()}.tmp.npy"
    np.save(tmp, arr)
    os.replace(tmp, path)


def build_corpus(work: str, seq_len: int, windows: int, mix: float, seed: int, keys: int = 0, task_weights=None,
                 share: float = EXTRA_SHARE, fresh: bool = False, copy_share: float = 0.0,
                 made_up_keys: bool = True) -> dict:
    """The training and held-out token files of one seed: ``windows`` training windows of
    ``seq_len`` stdlib tokens, a fraction ``mix`` of them holding retrieval content
    (:func:`retrieval_window`, extra pairs capped at ``share`` of a window) built into their own
    code; plain held-out code. Without ``fresh`` there are at most as many windows as the code
    holds, so a run longer than one epoch sees the same retrieval examples again (answers it can
    memorise); with ``fresh`` the code windows repeat as often as ``windows`` needs, each
    repetition with retrieval examples of its own. ``copy_share`` > 0: every window's code first
    gets that share of repeated spans (:func:`with_repeats`). ``made_up_keys=False``: extra keys from
    the evaluation's word list only (:func:`key_names`; the s8 study's corpora).
    Returns ``{"paths": (train, heldout), "windows", "code_windows", "retrieval_windows",
    "pairs_per_window", "sha", "seed"}``."""
    import hashlib

    import numpy as np

    from mtraining_jax.train.data import stdlib_streams
    from mtraining_jax.train.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    train, held = stdlib_streams(tok)
    n_code = len(train) // seq_len
    n = windows if fresh else min(windows, n_code)
    code = np.asarray(train[:n_code * seq_len], np.int32).reshape(n_code, seq_len)
    blocks = code[np.arange(n) % n_code].copy()
    rng = np.random.default_rng([seed, 20240518])
    weights = task_weights or {t: 1.0 for t in TRAIN_TASKS}
    names = [t for t in TRAIN_TASKS if weights.get(t, 0) > 0]
    prob = np.asarray([float(weights[t]) for t in names])
    prob = prob / prob.sum()
    uniform = len(names) == len(TRAIN_TASKS) and np.allclose(prob, prob[0])
    chosen, pairs = np.nonzero(rng.random(n) < mix)[0], []
    if copy_share > 0:  # drawn after the choice above, so copy_share=0 keeps earlier corpora
        copy_rng = np.random.default_rng([seed, 20240518, 1])
        blocks = np.stack([with_repeats(b, copy_share, copy_rng) for b in blocks])
    for w in chosen:
        # uniform weights draw as the first study did (its seed-0 corpus is reproduced with keys=0)
        task = names[int(rng.integers(len(names)))] if uniform else names[int(rng.choice(len(names), p=prob))]
        blocks[w], k = retrieval_window(tok, seq_len, task, rng, blocks[w], keys, share, made_up_keys)
        pairs.append(k)
    os.makedirs(work, exist_ok=True)
    paths = os.path.join(work, "train_tokens.npy"), os.path.join(work, "heldout_tokens.npy")
    flat = blocks.reshape(-1).astype(np.uint16)
    _save_atomic(paths[0], flat)  # the arms of a seed may build it at once (--gpu-per-arm): same bytes,
    _save_atomic(paths[1], np.asarray(held, np.uint16))  # and a reader never sees half a file
    return {"paths": paths, "windows": int(n), "code_windows": int(n_code), "retrieval_windows": int(len(chosen)),
            "pairs_per_window": float(np.mean(pairs)) if pairs else 0.0,
            "sha": hashlib.sha1(flat.tobytes()).hexdigest()[:12], "seed": int(seed)}


# ------------------------------------------------------------------ content copying (copy pretraining)


def induction_windows(S, n, rng, share=0.5, lengths=(8, 32), alphabet=26):
    """``(tokens int32 [n, S], mask bool [n, S])``: random lowercase strings in which spans of
    ``lengths`` tokens are copied to random LATER places (about ``share`` of each window). Unlike
    ``--repeat`` (one fixed offset, learnable by position alone), a copy can only be found by its
    content: the induction mechanism retrieval needs. ``mask``: the copied tokens after a span's
    first 3 (predictable from context), kept only where the copy still matches its source.
    ``alphabet``: 26 (lowercase letters: a token recurs ~S/26 times, so only a match on several
    tokens finds the source) or 256 (every byte: one token mostly finds it, the classic induction task)."""
    if S < 4 * lengths[1]:
        raise ValueError(f"induction windows of S={S} tokens are too short for copied spans of up to "
                         f"{lengths[1]} tokens: use a window of at least {4 * lengths[1]}")
    lo = ord("a") if alphabet == 26 else 0
    toks = rng.integers(lo, lo + alphabet, size=(n, S)).astype(np.int32)
    mask = np.zeros((n, S), bool)
    for w in range(n):
        spans, done = [], 0
        while done < share * S:
            L = int(rng.integers(lengths[0], lengths[1] + 1))
            src = int(rng.integers(0, S - 2 * L))
            dst = int(rng.integers(src + L, S - L + 1))
            toks[w, dst:dst + L] = toks[w, src:src + L]
            spans.append((src, dst, L))
            done += L
        for src, dst, L in spans:
            if np.array_equal(toks[w, dst:dst + L], toks[w, src:src + L]):
                mask[w, dst + 3:dst + L] = True
    return toks, mask


def build_induction_corpus(work, S, windows, seed, alphabet=26, held_windows=64):
    toks, _ = induction_windows(S, windows, np.random.default_rng(seed), alphabet=alphabet)
    held, _ = induction_windows(S, held_windows, np.random.default_rng(seed + 1), alphabet=alphabet)
    os.makedirs(work, exist_ok=True)
    paths = os.path.join(work, "train_tokens.npy"), os.path.join(work, "heldout_tokens.npy")
    np.save(paths[0], toks.astype(np.uint16).reshape(-1))
    np.save(paths[1], held.astype(np.uint16).reshape(-1))
    return {"paths": paths, "windows": windows}
