"""`pagoda serve --kv-cache-dtype float16`: the server's engine keeps a float16 KV cache and answers through
the OpenAI API as with the default one (SmolLM2's greedy tokens equal the float32 cache's here)."""

from __future__ import annotations

import openai


def _greedy_text(server) -> str:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Name three colours of the rainbow."}],
        temperature=0.0,
        max_tokens=40,
    )
    return reply.choices[0].message.content


def test_served_with_a_float16_kv_cache(start_server):
    half = start_server("--kv-cache-dtype", "float16")
    assert "float16" in next(line for line in half.log().splitlines() if "KV cache:" in line)
    full = start_server()
    assert "float32" in next(line for line in full.log().splitlines() if "KV cache:" in line)
    text = _greedy_text(half)
    assert text and text == _greedy_text(full)
