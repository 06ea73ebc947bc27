"""The HTTP API process (aiohttp, OpenAI-compatible). It talks to the engine only through
`pagoda.engine_core.protocol` over ZeroMQ and never imports torch."""
