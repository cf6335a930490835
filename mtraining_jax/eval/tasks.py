"""Synthetic long-context retrieval tasks, generated offline and deterministically from a seed.

Every example is a token sequence of ``S + 1`` tokens in natural order: a *haystack* (filler text
or real held-out text) with one or more *needles* inserted at given depths, then a question and the
answer. The model sees ``tokens[:S]``; ``answer [S]`` (bool) marks the label positions
``t`` whose target ``tokens[t + 1]`` is an answer token.

Tasks (RULER, Hsieh et al. 2024, adapted to plain continuation, no chat template):

* ``passkey`` / NIAH: ``"The pass key is 71432. Remember it. 71432 is the pass key."`` at depth
  ``d``; question ``"What is the pass key? The pass key is"``, answer ``" 71432"``;
* ``multikey``: ``num_keys`` needles ``"The special magic number for <word> is: <6 digits>."``
  with distinct words; the question asks for one of them (the others are distractors);
* ``multivalue``: ``num_values`` needles with the SAME word and different numbers; the answer
  lists all numbers in order of appearance (``" n1, n2, n3, n4"``);
* ``vartrack``: variable tracking, ``"VAR ABCDE = 12345."`` then a chain of ``hops`` assignments
  ``"VAR FGHIJ = VAR ABCDE."`` spread over the haystack, plus a distractor chain with another value;
  the answer lists the chain's variables in order.

Depth ``d in [0, 1]`` is the fraction of the haystack before the needle (multi-needle tasks place
their needles at seeded random depths). The same ``(seed, task, length, depth, sample)`` always
gives the same example, independent of the rest of the grid.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple, Optional

import numpy as np

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
WORDS = ("apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "piano", "candle", "forest",
         "silver", "rocket", "garden", "marble", "falcon", "harbor", "lemon", "comet", "violet", "anchor")
TASKS = ("passkey", "multikey", "multivalue", "vartrack")


class Example(NamedTuple):
    """``tokens int32 [S + 1]`` (natural order), ``answer bool [S]`` over label positions,
    ``text`` the answer string (for reports)."""

    tokens: np.ndarray
    answer: np.ndarray
    text: str


def example_rng(seed: int, task: str, seq_len: int, cell: int, sample: int) -> np.random.Generator:
    """The generator of one example (independent of which other examples are generated)."""
    return np.random.default_rng([int(seed), zlib.crc32(task.encode()), int(seq_len), int(cell), int(sample)])


def haystack(tokenizer, n: int, rng: np.random.Generator, stream: Optional[np.ndarray] = None) -> np.ndarray:
    """``int32 [n]`` filler: repeated :data:`FILLER` (``stream=None``) or a random window of a token
    ``stream`` (e.g. the held-out split; tiled when shorter than ``n``)."""
    if stream is None or len(stream) == 0:
        return np.resize(tokenizer.encode(FILLER), n).astype(np.int32)
    stream = np.asarray(stream)
    if len(stream) <= n:
        return np.resize(stream, n).astype(np.int32)
    at = int(rng.integers(0, len(stream) - n))
    return np.asarray(stream[at:at + n]).astype(np.int32)


def compose(tokenizer, seq_len: int, needles, depths, question: str, answer: str, rng,
            stream: Optional[np.ndarray] = None) -> Example:
    """Insert ``needles`` (strings) at ``depths`` of a haystack, then ``question`` + ``answer``;
    ``ValueError`` when they do not fit in ``seq_len + 1`` tokens."""
    ned = [tokenizer.encode(" " + s + " ") for s in needles]
    q, a = tokenizer.encode(question), tokenizer.encode(answer)
    room = seq_len + 1 - sum(len(x) for x in ned) - len(q) - len(a)
    if room < 0:
        raise ValueError(f"context length {seq_len} is too short for the task (needs "
                         f"{seq_len + 1 - room} tokens)")
    hay = haystack(tokenizer, room, rng, stream)
    cuts = [int(round(float(np.clip(d, 0.0, 1.0)) * room)) for d in depths]
    order = np.argsort(cuts, kind="stable")
    parts, prev = [], 0
    for i in order:
        parts += [hay[prev:cuts[i]], ned[i]]
        prev = cuts[i]
    parts += [hay[prev:], q, a]
    seq = np.concatenate(parts).astype(np.int32)
    assert len(seq) == seq_len + 1, (len(seq), seq_len)
    ans = np.zeros(seq_len, bool)
    ans[seq_len - len(a):] = True
    return Example(seq, ans, answer.strip())


def _number(rng, digits: int) -> str:
    return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def _var(rng) -> str:
    return "".join(chr(ord("A") + int(c)) for c in rng.integers(0, 26, size=5))


def passkey(tokenizer, seq_len, depth, rng, stream=None, digits: int = 5) -> Example:
    key = _number(rng, digits)
    return compose(tokenizer, seq_len, [f"The pass key is {key}. Remember it. {key} is the pass key."], [depth],
                   " What is the pass key? The pass key is", f" {key}", rng, stream)


def multikey(tokenizer, seq_len, depth, rng, stream=None, num_keys: int = 4) -> Example:
    words = [WORDS[i] for i in rng.choice(len(WORDS), size=num_keys, replace=False)]
    nums = [_number(rng, 6) for _ in words]
    depths = [depth] + list(rng.uniform(0, 1, size=num_keys - 1))  # the asked needle at `depth`
    needles = [f"The special magic number for {w} is: {n}." for w, n in zip(words, nums)]
    return compose(tokenizer, seq_len, needles, depths,
                   f" What is the special magic number for {words[0]}? The special magic number for "
                   f"{words[0]} is:", f" {nums[0]}", rng, stream)


def multivalue(tokenizer, seq_len, depth, rng, stream=None, num_values: int = 4) -> Example:
    word = WORDS[int(rng.integers(len(WORDS)))]
    nums = [_number(rng, 6) for _ in range(num_values)]
    depths = np.sort(rng.uniform(0, 1, size=num_values))  # answer order = order of appearance
    needles = [f"The special magic number for {word} is: {n}." for n in nums]
    return compose(tokenizer, seq_len, needles, depths,
                   f" What are all the special magic numbers for {word}? The special magic numbers for "
                   f"{word} are:", " " + ", ".join(nums), rng, stream)


def vartrack(tokenizer, seq_len, depth, rng, stream=None, hops: int = 4) -> Example:
    names = []
    while len(names) < 2 * (hops + 1):  # chain + distractor chain, distinct names
        v = _var(rng)
        if v not in names:
            names.append(v)
    chain, other = names[:hops + 1], names[hops + 1:]
    val, val2 = _number(rng, 5), _number(rng, 5)
    while val2 == val:
        val2 = _number(rng, 5)
    needles, depths = [], []
    for ch, value in ((chain, val), (other, val2)):
        d = np.sort(rng.uniform(0, 1, size=len(ch)))
        needles += [f"VAR {ch[0]} = {value}."] + [f"VAR {ch[i]} = VAR {ch[i - 1]}." for i in range(1, len(ch))]
        depths += list(d)
    return compose(tokenizer, seq_len, needles, depths,
                   f" Find all variables that are assigned the value {val}. Answer: they are",
                   " " + " ".join(chain), rng, stream)


GENERATORS = {"passkey": passkey, "multikey": multikey, "multivalue": multivalue, "vartrack": vartrack}


def make_example(task: str, tokenizer, seq_len: int, depth: float, seed: int, cell: int, sample: int,
                 stream=None) -> Example:
    """One example of ``task`` (see module docstring); ``ValueError`` for an unknown task."""
    if task not in GENERATORS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    return GENERATORS[task](tokenizer, seq_len, depth, example_rng(seed, task, seq_len, cell, sample), stream)
