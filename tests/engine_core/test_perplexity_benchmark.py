"""benchmarks/perplexity.py's method: its windows score every token but the first exactly once, within
the window's context, and its negative log-likelihood through prompt_logprobs equals HF transformers'
over the same windows (on the bundled text's first 300 tokens)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.perplexity import TEXT, make_windows, pagoda_nll
from tests.helpers import hf_prompt_logprobs


@pytest.mark.parametrize(
    ("num_tokens", "window", "stride"), [(1000, 128, 64), (1000, 128, 127), (130, 128, 100), (100, 128, 1)]
)
def test_windows_score_each_token_once_with_its_window_as_context(num_tokens, window, stride):
    windows = make_windows(num_tokens, window, stride)
    scored = [begin + i for begin, end, first in windows for i in range(first, end - begin)]
    assert scored == list(range(1, num_tokens))
    assert all(end - begin <= window and first >= 1 for begin, end, first in windows)
    assert windows[0][0] == 0 and windows[-1][1] == num_tokens
    for bad_stride in (0, window):  # no overlap: each window's first token would have no context
        with pytest.raises(ValueError):
            make_windows(num_tokens, window, bad_stride)


def test_windowed_nll_equals_hf(default_model_dir, hf_model, tokenizer):
    tokens = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)[:300]
    windows = make_windows(len(tokens), 128, 64)
    nll, count = pagoda_nll(str(default_model_dir), "none", "float32", tokens, windows)
    expected = 0.0
    for begin, end, first in windows:
        ids = tokens[begin:end]
        reference = hf_prompt_logprobs(hf_model, ids)
        expected -= sum(reference[i - 1, ids[i]].item() for i in range(first, len(ids)))
    assert count == len(tokens) - 1
    assert math.isclose(nll, expected, rel_tol=1e-5)
    assert 1 < math.exp(nll / count) < torch.finfo(torch.float32).max
