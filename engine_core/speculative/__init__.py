"""Speculative decoding: a proposer guesses each request's next tokens, the target model checks them all
in one forward pass (engine_core/speculative/verify.py), and every guess it would have produced itself
is kept. See docs/speculative-decoding.md."""
