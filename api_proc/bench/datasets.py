"""Benchmark request sets: random (exact lengths), ShareGPT (a user's file, or a bundled synthetic set),
and shared-prefix. Every set is deterministic for a given seed.

A prompt is token ids where lengths must be exact (random, prefix: sent as token-id prompts to the
completions endpoint) or text (ShareGPT-style conversations). `prompt_len` is exact for token ids and
a tokenizer count (or, without a tokenizer, an estimate) for text; servers' own usage figures are
what the report counts.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

_WORDS_PER_TOKEN = 0.75  # English prose, for estimates when no tokenizer is at hand
_VOCABULARY = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will more about what up out "
    "them into can time some could these two may first then do any like my now over such our man me even most "
    "made after also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three explain why model server memory token cache request answer "
    "question write story code python function list data reason example number water light city river music"
).split()


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    vocab_range: tuple[int, int] = (100, 30000),
) -> list[BenchRequest]:
    """Random token ids; lengths uniform in [len * (1 - r), len * (1 + r)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--range-ratio must be in [0, 1)")
    rng = random.Random(seed)

    def length(center: int) -> int:
        low, high = max(1, int(center * (1 - range_ratio))), max(1, int(center * (1 + range_ratio)))
        return rng.randint(low, high)

    out = []
    for _ in range(num):
        n_in = length(input_len)
        out.append(BenchRequest([rng.randrange(*vocab_range) for _ in range(n_in)], n_in, length(output_len)))
    return out


def prefix_requests(
    num: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    vocab_range: tuple[int, int] = (100, 30000),
) -> list[BenchRequest]:
    """`num` requests sharing one random prefix of `prefix_len` tokens, plus `input_len` unique ones."""
    rng = random.Random(seed)
    prefix = [rng.randrange(*vocab_range) for _ in range(prefix_len)]
    return [
        BenchRequest(
            prefix + [rng.randrange(*vocab_range) for _ in range(input_len)], prefix_len + input_len, output_len
        )
        for _ in range(num)
    ]


def _count(tokenizer, text: str) -> int:
    if tokenizer is None:
        return max(1, round(len(text.split()) / _WORDS_PER_TOKEN))
    return len(tokenizer.encode(text, add_special_tokens=False))


def synthetic_sharegpt(num: int, seed: int = 0, tokenizer=None) -> list[BenchRequest]:
    """A bundled stand-in for ShareGPT on machines without it: prompt and output lengths drawn from
    log-normal distributions shaped like ShareGPT's (median ~150 prompt and ~180 output tokens,
    long tails, clipped to 4..1024 / 4..1024), with prompts made of English words."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        prompt_tokens = min(1024, max(4, int(rng.lognormvariate(math.log(150), 0.9))))
        output_len = min(1024, max(4, int(rng.lognormvariate(math.log(180), 0.8))))
        words = [rng.choice(_VOCABULARY) for _ in range(max(1, int(prompt_tokens * _WORDS_PER_TOKEN)))]
        text = " ".join(words).capitalize() + "?"
        out.append(BenchRequest(text, _count(tokenizer, text), output_len))
    return out


def sharegpt_file(path: str | Path, num: int, seed: int = 0, tokenizer=None) -> list[BenchRequest]:
    """ShareGPT JSON: the first human turn is the prompt, the first reply's length the output length.
    Like vLLM's loader, pairs with fewer than 4 tokens either side or over 1024/2048 are skipped."""
    data = json.loads(Path(path).read_text())
    rng = random.Random(seed)
    rng.shuffle(data)
    out = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        prompt_len, output_len = _count(tokenizer, prompt), _count(tokenizer, reply)
        if prompt_len < 4 or output_len < 4 or prompt_len > 1024 or prompt_len + output_len > 2048:
            continue
        out.append(BenchRequest(prompt, prompt_len, output_len))
        if len(out) == num:
            break
    if len(out) < num:
        raise ValueError(f"{path} holds only {len(out)} usable conversations; asked for {num}")
    return out


def as_text(requests: list[BenchRequest], tokenizer) -> list[BenchRequest]:
    """Token-id prompts decoded to text, for endpoints that take text only (chat)."""
    out = []
    for r in requests:
        if isinstance(r.prompt, str):
            out.append(r)
        else:
            if tokenizer is None:
                raise ValueError("a token-id dataset on the chat endpoint needs --tokenizer to make text")
            out.append(BenchRequest(tokenizer.decode(r.prompt), r.prompt_len, r.output_len))
    return out
