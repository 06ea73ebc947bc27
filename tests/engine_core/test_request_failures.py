"""A failure caused by one request's data ends that request alone: the engine reports it (`RequestFailed`),
returns its blocks, and gives every other request in the same steps exactly the tokens it gets alone."""

from __future__ import annotations

import math

import pytest

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.protocol import RequestFailed
from pagoda.engine_core.request import Request
from pagoda.engine_core.sampling_params import SamplingParams
from tests import tiny_models

POISON = 100  # its embedding row is NaN: a prompt holding it gives NaN logits


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path_factory.mktemp("nan-embedding")
    tiny_models.build("llama").save_pretrained(model_dir)
    weights = load_file(model_dir / "model.safetensors")
    weights["model.embed_tokens.weight"][POISON] = math.nan
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    return EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=64))


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
GOOD = [[5, 6, 7, 8, 9] * 4, [11, 12, 13], list(range(20, 60))]


def _run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Each request's tokens, and the requests the engine reported as failed."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {}
    failed = set()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        for ended in engine.take_ended():
            assert isinstance(ended, RequestFailed) and "not finite" in ended.message
            failed.add(ended.request_id)
        engine.check_integrity()
    return tokens, failed


def test_nan_logits_fail_their_request_alone(engine):
    alone, failed = _run(engine, {f"good{i}": (p, GREEDY) for i, p in enumerate(GOOD)})
    assert not failed
    mixed = {f"good{i}": (p, GREEDY) for i, p in enumerate(GOOD)}
    mixed["bad-greedy"] = ([5, POISON, 6], GREEDY)
    mixed["bad-sampled"] = ([POISON] * 30, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, logprobs=2))
    mixed["bad-late"] = (GOOD[0] + [POISON], GREEDY)  # (its cached prefix is clean; its last token is not)
    tokens, failed = _run(engine, mixed)
    assert failed == {"bad-greedy", "bad-sampled", "bad-late"}
    assert not failed & tokens.keys()  # not one token of theirs went out
    assert tokens == alone
    again, failed = _run(engine, {f"good{i}": (p, GREEDY) for i, p in enumerate(GOOD)})  # the freed blocks reused
    assert again == alone and not failed


def test_an_error_taking_one_request_s_tokens_fails_that_request_alone(engine, monkeypatch):
    """A bug that raises on one request's tokens (here injected: no request data can raise there today)."""
    alone, _ = _run(engine, {"a": (GOOD[0], GREEDY), "b": (GOOD[1], GREEDY)})
    real = Request.append_token

    def append_token(self, token_id):
        if self.request_id == "b" and self.num_output_tokens == 3:
            raise RuntimeError("injected")
        real(self, token_id)

    monkeypatch.setattr(Request, "append_token", append_token)
    tokens = {}
    engine.add_request("a", GOOD[0], GREEDY)
    engine.add_request("b", GOOD[1], GREEDY)
    ended = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        ended += engine.take_ended()
        engine.check_integrity()
    assert [(type(e), e.request_id) for e in ended] == [(RequestFailed, "b")]
    assert "injected" not in ended[0].message  # the client is told what happened, not the exception's text
    assert tokens["a"] == alone["a"] and tokens["b"] == alone["b"][:3]
