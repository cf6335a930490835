"""Data: packing, labels shifted before the layout permutation, resumable seeded iteration,
token/text/stdlib/passkey sources, tokenizer."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mtraining_jax.layouts import LAYOUTS, Layout
from mtraining_jax.train import data as D
from mtraining_jax.train.config import DataConfig
from mtraining_jax.train.tokenizer import ByteTokenizer, load_tokenizer


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(LAYOUTS),
    ranks=st.sampled_from([1, 2, 4, 8]),
    mult=st.integers(1, 3),
    batch=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_labels_are_next_tokens_in_natural_order_after_layout(name, ranks, mult, batch, seed):
    stripe = 4
    S = stripe * ranks * 2 * mult
    layout = Layout(name, S, ranks, stripe)
    stream = np.arange(S * (batch * 3) + 1, dtype=np.int32) * 7 % 65521  # distinct, not sorted
    loader = D.PackedLoader(stream, S, batch, layout, seed=seed)
    b = next(loader)
    assert b.tokens.shape == b.labels.shape == b.mask.shape == (batch, S)
    np.testing.assert_array_equal(b.positions, layout.perm)
    nat_t, nat_l = layout.unpermute(b.tokens, axis=-1), layout.unpermute(b.labels, axis=-1)
    # in natural order each row is a window of the stream, and labels are the window shifted by one
    np.testing.assert_array_equal(nat_l[:, :-1], nat_t[:, 1:])
    idx = {int(v): i for i, v in enumerate(stream)}
    for row_t, row_l in zip(nat_t, nat_l):
        start = idx[int(row_t[0])]
        assert start % S == 0
        np.testing.assert_array_equal(row_t, stream[start:start + S])
        assert row_l[-1] == stream[start + S]
    # laid token i sits at global position perm[i] of its window
    for r in range(batch):
        np.testing.assert_array_equal(b.tokens[r], nat_t[r][layout.perm])


def test_loader_is_deterministic_and_resumes_exactly():
    stream = np.arange(10_000, dtype=np.int32)
    layout = Layout("block_striped", 64, 2, 8)
    a = D.PackedLoader(stream, 64, 2, layout, seed=3, accum=2)
    seq = [next(a) for _ in range(50)]  # crosses epochs (156 windows / 4 per step)
    assert seq[0].tokens.shape == (2, 2, 64)
    b = D.PackedLoader(stream, 64, 2, layout, seed=3, accum=2)
    for _ in range(20):
        next(b)
    state = json.loads(json.dumps(b.get_state()))  # what the checkpoint stores
    c = D.PackedLoader(stream, 64, 2, layout, seed=3, accum=2)
    c.set_state(state)
    for want in seq[20:]:
        got = next(c)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.labels, want.labels)
    assert c.get_state()["epoch"] >= 1
    other = D.PackedLoader(stream, 64, 2, layout, seed=4, accum=2)
    assert not np.array_equal(next(other).tokens, seq[0].tokens)
    # an epoch visits every window exactly once
    e = D.PackedLoader(np.arange(64 * 10 + 1), 64, 1, None, seed=0)
    starts = sorted(int(next(e).tokens[0, 0]) for _ in range(10))
    assert starts == list(range(0, 640, 64))


def test_too_little_data_is_rejected():
    with pytest.raises(ValueError, match="fewer than one batch of 4 sequences"):
        D.PackedLoader(np.arange(100), 32, 2, None, accum=2)


def test_token_files_npy_and_raw(tmp_path):
    arr = (np.arange(5000) % 300).astype(np.uint16)
    np.save(tmp_path / "t.npy", arr)
    arr.tofile(tmp_path / "t.bin")
    a = D.token_file_stream(str(tmp_path / "t.npy"))
    b = D.token_file_stream(str(tmp_path / "t.bin"), "uint16")
    np.testing.assert_array_equal(a, arr)
    np.testing.assert_array_equal(b, arr)
    cfg = DataConfig(source="tokens", path=str(tmp_path / "t.bin"), heldout_percent=10, seq_len=64)
    tr, held = D.build_streams(cfg, ByteTokenizer())
    assert len(tr) == 4500 and len(held) == 500
    with pytest.raises(ValueError, match="missing.bin"):
        D.token_file_stream(str(tmp_path / "missing.bin"))


def test_text_and_jsonl_through_byte_tokenizer(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "hi"}\n\n{"text": "yo!"}\n')
    s = D.text_stream(str(tmp_path / "a.jsonl"), ByteTokenizer())
    assert s.tolist() == [104, 105, 258, 121, 111, 33, 258]
    (tmp_path / "b.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="no field 'text'"):
        D.text_stream(str(tmp_path / "b.jsonl"), ByteTokenizer())
    (tmp_path / "c.txt").write_text("héllo")
    t = ByteTokenizer()
    assert t.decode(D.text_stream(str(tmp_path / "c.txt"), t)) == "héllo"
    with pytest.raises(ValueError, match="tok.json"):
        load_tokenizer(str(tmp_path / "tok.json"))


def test_stdlib_corpus_split_is_deterministic_and_disjoint():
    files = D.stdlib_files()
    assert len(files) > 200 and all(f.endswith(".py") for f in files)
    held = [f for f in files if D.is_heldout(f, 5.0)]
    assert 0.02 < len(held) / len(files) < 0.09
    assert held == [f for f in D.stdlib_files() if D.is_heldout(f, 5.0)]
    tr, ho = D.stdlib_streams(ByteTokenizer(), 5.0)
    assert len(tr) > 10 * len(ho) > 0
    assert tr.max() <= 258 and (tr == 258).sum() == len(files) - len(held)
    assert b"def " in bytes(tr[:200_000].astype(np.uint8))


def test_passkey_sequences():
    tok = ByteTokenizer()
    rng = np.random.default_rng(0)
    layout = Layout("block_striped", 512, 4, 16)
    b = D.passkey_batch(tok, 512, 3, rng, layout, digits=5)
    nat_t = layout.unpermute(b.tokens, axis=-1)
    nat_l = layout.unpermute(b.labels, axis=-1)
    nat_m = layout.unpermute(b.mask, axis=-1)
    for t, l, m in zip(nat_t, nat_l, nat_m):
        text = tok.decode(np.concatenate([t, l[-1:]]))
        key = text.split("The pass key is ")[1][:5]
        assert key.isdigit() and text.endswith(f"The pass key is {key}")
        assert m.sum() == 6 and tok.decode(l[m == 1]) == f" {key}"  # space + 5 digits
    with pytest.raises(ValueError, match="too short"):
        D.passkey_example(tok, 40, rng)


def test_tokenizers_file_through_text_source(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")  # the "hf" extra (installed in CI)
    vocab = {"<|endoftext|>": 0, "hello": 1, "world": 2, "[UNK]": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    t = load_tokenizer(str(tmp_path / "tok.json"))
    assert t.vocab_size == 4 and t.eos_id == 0
    (tmp_path / "d.jsonl").write_text('{"text": "hello world"}\n{"text": "world moon"}\n')
    assert D.text_stream(str(tmp_path / "d.jsonl"), t).tolist() == [1, 2, 0, 2, 3, 0]


def test_passkey_loader_is_resumable():
    tok = ByteTokenizer()
    a = D.PasskeyLoader(tok, 256, 2, None, seed=5, accum=2)
    seq = [next(a) for _ in range(4)]
    assert seq[0].tokens.shape == (2, 2, 256) and float(seq[0].mask.min()) == 1.0
    b = D.PasskeyLoader(tok, 256, 2, None, seed=5, accum=2)
    next(b)
    c = D.PasskeyLoader(tok, 256, 2, None, seed=5, accum=2)
    c.set_state(b.get_state())
    for want in seq[1:]:
        np.testing.assert_array_equal(next(c).tokens, want.tokens)
    assert not np.array_equal(seq[0].tokens, seq[1].tokens)
