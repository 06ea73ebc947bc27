"""N-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence of the
request's last n tokens, for the longest n between `prompt_lookup_min` and `prompt_lookup_max` that
occurred before.

Outputs that copy spans of their prompt (summaries, code edits, quoting) hit often; free text rarely, and
a miss costs only the lookup. The search is vectorised numpy over each request's tokens (prompt and
output): one comparison of every window against the suffix per n.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` proposed next tokens for the sequence `tokens` (int64), or [] when no suffix of
    length min_n..max_n occurred earlier."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        windows = sliding_window_view(tokens[: length - 1], n)  # every earlier window (not the suffix)
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if len(matches):
            start = int(matches[-1]) + n  # the latest occurrence: the most recent context
            return tokens[start : start + k].tolist()
    return []
