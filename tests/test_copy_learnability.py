"""The retrieval-learnability probes' data (``benchmarks/copy_learnability.py``): what the copied-token
scores are measured on must be solvable by content and only by content."""

import numpy as np
import pytest

from benchmarks.copy_learnability import build_induction_corpus, induction_windows


def _one_token_induction(toks, mask):
    """Accuracy on the masked tokens of: find the latest earlier occurrence of the previous token,
    predict the token after it (the one-token induction rule)."""
    hit = tot = 0
    for w in range(len(toks)):
        for p in np.nonzero(mask[w])[0]:
            prev = toks[w, p - 1]
            earlier = np.nonzero(toks[w, :p - 1] == prev)[0]
            hit += bool(len(earlier)) and toks[w, earlier[-1] + 1] == toks[w, p]
            tot += 1
    return hit / tot


@pytest.mark.parametrize("alphabet", [26, 256])
def test_induction_windows_copies_are_found_by_content(alphabet):
    S = 257
    toks, mask = induction_windows(S, 12, np.random.default_rng(3), alphabet=alphabet)
    lo = ord("a") if alphabet == 26 else 0
    assert toks.shape == mask.shape == (12, S) and toks.min() >= lo and toks.max() < lo + alphabet
    assert 0.1 < mask.mean() < 0.5  # about half of each window is copies, the first 3 of a span unscored
    # every scored token continues a copy of an earlier span: the token two back to one back recurs
    # earlier in the window followed by the scored token (the copy's source)
    for w in range(12):
        for p in np.nonzero(mask[w])[0]:
            pair = toks[w, p - 2:p + 1]
            assert any(np.array_equal(toks[w, j:j + 3], pair) for j in range(p - 2)), (w, p)
    acc = _one_token_induction(toks, mask)
    if alphabet == 256:  # a byte mostly occurs once in 257 tokens: one token finds the source
        assert acc > 0.75, acc
    else:  # 26 letters recur ~10 times: a one-token match is mostly wrong, a longer one is needed
        assert acc < 0.5, acc


def test_build_induction_corpus_sizes(tmp_path):
    info = build_induction_corpus(str(tmp_path), 128, 5, 0, alphabet=256, held_windows=9)
    train, held = (np.load(p) for p in info["paths"])
    assert train.dtype == held.dtype == np.uint16
    assert train.size == 5 * 128 and held.size == 9 * 128 and info["windows"] == 5


def test_induction_windows_too_short_is_refused_up_front():
    with pytest.raises(ValueError, match="S=64 .*at least 128"):
        induction_windows(64, 2, np.random.default_rng(0), alphabet=256)
    toks, mask = induction_windows(128, 2, np.random.default_rng(0), alphabet=256)
    assert toks.shape == (2, 128) and mask.any()


def test_plot_of_the_committed_gpu_probes(tmp_path):
    """The committed ``gpu-*`` rows: slices -a/-b/-c chain into one curve of 3 x 2500 steps x 4096 x 8
    tokens; the seeds of s11 keep their own curves; tokens per step come from each row's command."""
    import json
    import os

    from benchmarks import copy_learnability_plot as cp

    assert cp.tokens_per_step("x --seq-len 256 --batch 256") == 65536 and cp.tokens_per_step("x") == 512 * 8
    rows = [json.loads(line) for line in open(cp.ROWS)]
    nll = cp.curves(rows, "copied_nll")
    four_k = nll["76m-induction-4k-lr1e-3"]
    assert four_k[-1][0] == pytest.approx(3 * 2500 * 4096 * 8 / 1e6) and four_k[-1][1] > 5.5
    assert [x for x, _ in four_k] == sorted(x for x, _ in four_k)
    assert nll["2layer-induction-256-lr1e-3"][-1][1] < 1.0
    held = cp.curves(rows, "heldout_loss")
    seeds = [held[f"76m-induction-256-lr3e-4-seed{s}"] for s in range(4)]
    assert all(c[-1][0] == pytest.approx(4000 * 65536 / 1e6) and c[-1][1] < 4.7 for c in seeds)
    assert not any(f"76m-induction-256-lr3e-4-seed{s}" in nll for s in range(4))  # not scored: no copied nll
    out = cp.plot(rows, str(tmp_path / "p.png"))
    assert os.path.getsize(out) > 10_000
