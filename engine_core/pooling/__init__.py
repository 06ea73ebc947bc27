"""Pooling models (embeddings): a second kind of engine beside generation (docs/embeddings.md).

A pooling request runs its whole prompt in one step and ends there with a vector (or one per token),
so this engine keeps no KV cache: `scheduler.py` batches whole prompts under the token budget,
`runner.py` runs the model over them with attention inside each prompt (bidirectional for encoders,
causal for decoders) and pools (`pooler.py`), `engine.py` ties them together behind the same interface
as the generating `EngineCore`. `config.py` reads how a model pools (sentence-transformers' files), and
`params.py` what one request asks for. This package's __init__ imports nothing: `params` is read by
processes that never load torch.
"""
