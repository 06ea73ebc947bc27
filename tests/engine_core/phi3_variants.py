"""The tiny Phi-3 models' LongRoPE variants (tests/tiny_models.py's phi3 changed): test_phi3.py and
test_gguf_phi3.py build theirs from here."""

from __future__ import annotations

ORIGINAL = 64  # LongRoPE's original context: the tiny models' max_position_embeddings (1,024) is 16x
HEAD_DIM = 16  # (hidden 128 over 8 heads)


def _longrope(rotary_dim: int) -> dict:
    """Short factors near 1, long ones far from it: the two lists give different tokens."""
    pairs = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
        "long_factor": [1.5 + 2.0 * i for i in range(pairs)],
    }


# variant -> what differs from tests/tiny_models.py's phi3
VARIANTS = {
    "phi3": dict(rope_scaling=_longrope(HEAD_DIM), original_max_position_embeddings=ORIGINAL),
    # Phi-4-mini: the first 3/4 of each head rotated, tied embeddings
    "phi4-mini": dict(
        rope_scaling=_longrope(HEAD_DIM * 3 // 4),
        original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=0.75,
        tie_word_embeddings=True,
    ),
}
