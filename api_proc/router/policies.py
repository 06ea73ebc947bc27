"""Which backend a request goes to (`--policy`).

- `p2c` (the default): power of two choices. Two distinct backends in rotation are drawn at random and
  the one with the lower load score wins (`Backend.score`: in-flight requests, or the running and
  waiting requests a Pagoda backend reports, scaled by its KV-cache usage). Nearly the balance of
  always taking the least loaded, without every router herding onto the same backend, and a stalled
  backend, whose requests pile up in flight, stops being chosen.
- `round_robin`: backends in rotation in turn, in --backend order, ignoring load (the baseline).
- `prefix`: rendezvous (highest random weight) hashing of the prompt's first PREFIX_CHARS characters,
  about 256 tokens' worth (the prompt, its first token ids, or the chat messages' roles and text), so
  that requests sharing a prefix land where it is cached; adding or ejecting a backend moves only the
  prefixes that hashed to it. The chosen backend is skipped for P2C when it is overloaded by SGLang's
  imbalance test (detok_proc/routing.py: more than 64 requests and 1.5 times above the least loaded),
  and so are requests with no prompt to hash.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Any

import msgspec

from pagoda.api_proc.router.backends import Backend
from pagoda.detok_proc.routing import overloaded
from pagoda.engine_core.json_limits import too_deep_field

POLICIES = ("p2c", "round_robin", "prefix")
PREFIX_CHARS = 1024  # ~256 tokens of English text
PREFIX_TOKENS = 256  # a prompt given as token ids


class _Prompted(msgspec.Struct):
    """The only fields of a request body the prefix policy reads (msgspec skips the rest unparsed)."""

    prompt: str | list[Any] | None = None
    messages: list[Any] | None = None


_decode_prompted = msgspec.json.Decoder(_Prompted).decode


def prefix_key(body: bytes | None) -> bytes | None:
    """What the prefix policy hashes: the start of the prompt or of the messages, as UTF-8; None when
    the body has neither (or is not JSON: the backend will say what is wrong with it)."""
    if not body or too_deep_field(body) is not None:  # never parse what the backend would refuse as too deep
        return None
    try:
        fields = _decode_prompted(body)
    except msgspec.DecodeError:
        return None
    text = _prompt_text(fields.prompt) if fields.prompt is not None else _messages_text(fields.messages or [])
    return text[:PREFIX_CHARS].encode("utf-8", "surrogatepass") if text else None


def _prompt_text(prompt: str | list[Any]) -> str:
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        return ""
    first = prompt[0]
    if isinstance(first, (str, list)):  # a batch of prompts: the first one
        return _prompt_text(first)
    return ",".join(str(token) for token in prompt[:PREFIX_TOKENS])  # token ids


def _messages_text(messages: list[Any]) -> str:
    parts: list[str] = []
    size = 0
    for message in messages:
        if size >= PREFIX_CHARS:
            break
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):  # content parts: their text
            content = "".join(
                p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        part = f"{message.get('role')}: {content if isinstance(content, str) else ''}\n"
        parts.append(part)
        size += len(part)
    return "".join(parts)


def rendezvous(key: bytes, candidates: Sequence[Backend]) -> Backend:
    """The candidate whose hash with `key` is highest: stable while the candidates stay, and spread evenly."""

    def weight(backend: Backend) -> bytes:
        return hashlib.blake2b(key + b"\0" + backend.url.encode(), digest_size=8).digest()

    return max(candidates, key=weight)


class Picker:
    """One policy's choices; holds its random generator and the round-robin position."""

    def __init__(self, policy: str, seed: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self.policy = policy
        self.rng = random.Random(seed)
        self._next = 0  # round robin: the --backend index to take next

    def pick(self, candidates: Sequence[Backend], key: bytes | None = None) -> Backend:
        """A backend among `candidates` (non-empty; those in rotation that this request has not tried)."""
        if self.policy == "round_robin":
            return self._round_robin(candidates)
        if self.policy == "prefix" and key is not None:
            chosen = rendezvous(key, candidates)
            if not overloaded(chosen.score, min(c.score for c in candidates)):
                return chosen
        return self._p2c(candidates)

    def _p2c(self, candidates: Sequence[Backend]) -> Backend:
        if len(candidates) == 1:
            return candidates[0]
        first, second = self.rng.sample(candidates, 2)  # in random order: a tie goes either way
        return first if first.score <= second.score else second

    def _round_robin(self, candidates: Sequence[Backend]) -> Backend:
        later = [c for c in candidates if c.index >= self._next]
        chosen = min(later or candidates, key=lambda c: c.index)
        self._next = chosen.index + 1
        return chosen
