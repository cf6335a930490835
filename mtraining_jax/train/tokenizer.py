"""Tokenizers: a byte-level tokenizer (no download) and a thin wrapper over a ``tokenizers`` file.

Byte-level: token ``b`` is byte ``b`` of the UTF-8 text (0..255), then the specials
``<pad>=256, <bos>=257, <eos>=258``; ``vocab_size = 259``. Model vocabularies may be larger (the
extra rows are simply never targets).
"""

from __future__ import annotations

import os

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes as tokens plus ``pad``/``bos``/``eos`` specials."""

    name = "byte"
    pad_id, bos_id, eos_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str) -> np.ndarray:
        """``str -> int32 [n]`` (one token per UTF-8 byte)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_bytes(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        ids = np.asarray(ids)
        return bytes(int(i) for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file (optional dependency ``tokenizers``)."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ValueError(
                f"data.tokenizer={path!r} needs the 'tokenizers' package (pip install tokenizers)"
            ) from e
        self.name = path
        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()
        eos = None
        for cand in ("<|endoftext|>", "</s>", "<eos>", "<|eot_id|>"):
            eos = self._tok.token_to_id(cand)
            if eos is not None:
                break
        self.eos_id = eos if eos is not None else 0
        self.pad_id = self.eos_id
        self.bos_id = self.eos_id

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids)])


def load_tokenizer(spec: str):
    """``"byte"`` -> :class:`ByteTokenizer`; a path -> :class:`HFTokenizer`."""
    if spec == "byte":
        return ByteTokenizer()
    if not os.path.isfile(spec):
        raise ValueError(f"data.tokenizer file {spec!r} does not exist (use 'byte' for the built-in one)")
    return HFTokenizer(spec)
