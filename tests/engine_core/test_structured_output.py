"""Structured output on the real model (offline engine): every sampled output follows its constraint,
free neighbours are unaffected, preemption keeps the grammar state right, bad specs are refused."""

from __future__ import annotations

import ast
import json
import re
import threading

import jsonschema
import pytest

from pagoda.engine_core import LLM, SamplingParams, StructuredOutputsParams, structured_output
from pagoda.engine_core.json_schema_support import unsupported_feature
from pagoda.engine_core.structured_output import LOAD_NICENESS

EOS = 2
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 30},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4},
        "active": {"type": "boolean"},
        "manager": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 15}]},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
}
ASK = [{"role": "user", "content": "Describe an employee of a small company as JSON."}]
# Arithmetic with at most one level of parentheses, so every sample is short enough to finish.
ARITHMETIC = r"""
root ::= expr
expr ::= term (" " op " " term){0,3}
term ::= num | "(" inner ")"
inner ::= num (" " op " " num){1,3}
op ::= "+" | "-" | "*"
num ::= [1-9] [0-9]{0,2}
"""


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), kv_cache_memory="512MiB")


def constrained(n: int, seed: int, max_tokens: int = 256, **spec) -> SamplingParams:
    return SamplingParams(
        n=n, seed=seed, temperature=1.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**spec)
    )


def completions(outputs):
    return [c for out in outputs for c in out.outputs]


def test_fifty_sampled_json_outputs_all_validate_and_end_at_once(llm):
    params = [constrained(10, seed, json=PERSON) for seed in (100, 200, 300, 400, 500)]  # seeds s..s+9
    outs = completions(llm.chat([ASK] * 5, params, use_tqdm=False))
    validator = jsonschema.Draft202012Validator(PERSON, format_checker=jsonschema.FormatChecker())
    assert len(outs) == 50 and len({c.text for c in outs}) > 40  # really sampled
    for c in outs:
        validator.validate(json.loads(c.text))
        # Complete value -> EOS the very next token; compact JSON: no newline, no run of spaces.
        assert c.finish_reason == "stop" and c.token_ids[-1] == EOS
        assert "\n" not in c.text and "  " not in re.sub(r'"(?:[^"\\]|\\.)*"', '""', c.text)


def test_regex_choice_and_grammar_outputs_always_match(llm):
    regex = r"[A-Z][a-z]{2,8}-[0-9]{2,4}(\.[0-9]{1,2})?"
    outs = completions(
        llm.generate(["Product code:"] * 2, [constrained(10, s, 40, regex=regex) for s in (1, 2)], use_tqdm=False)
    )
    assert all(re.fullmatch(regex, c.text) and c.finish_reason == "stop" for c in outs)
    assert len({c.text for c in outs}) > 5

    cities = ["Paris", "London", "Rome", "New York", "São Paulo"]
    outs = completions(
        llm.chat(
            [[{"role": "user", "content": "Name a city."}]] * 2,
            [constrained(10, s, 16, choice=cities) for s in (1, 2)],
            use_tqdm=False,
        )
    )
    assert all(c.text in cities and c.finish_reason == "stop" for c in outs)

    outs = completions(
        llm.generate(["Arithmetic:"] * 2, [constrained(10, s, 80, grammar=ARITHMETIC) for s in (1, 2)], use_tqdm=False)
    )
    for c in outs:
        tree = ast.parse(c.text, mode="eval")  # parses as an expression of + - * over integers
        assert all(
            isinstance(node, (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult))
            for node in ast.walk(tree)
        ), c.text
        assert c.finish_reason == "stop"


def test_json_object_and_logprobs_under_a_mask(llm):
    params = SamplingParams(
        temperature=1.0,
        seed=0,
        max_tokens=120,
        logprobs=2,
        structured_outputs=StructuredOutputsParams(json_object=True),
    )
    out = llm.chat(ASK, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)  # (this seed ends at 55 tokens)
    assert len(out.logprobs) == len(out.token_ids)  # raw logprobs, as without a constraint
    assert all(entry[token].logprob <= 0.0 for token, entry in zip(out.token_ids, out.logprobs, strict=True))


def test_logprobs_under_a_grammar_are_the_models_own(llm):
    """The grammar masks what may be drawn, not the reported logprobs: at the first generated position the
    constrained request's top logprobs are the unconstrained one's (the same prompt, the same raw logits),
    although the grammar allows only a few of those tokens there (masked and renormalised they would
    differ)."""
    free = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    constrained_params = SamplingParams(
        temperature=0, max_tokens=1, logprobs=5, structured_outputs=StructuredOutputsParams(json=PERSON)
    )
    (plain,) = llm.chat([ASK], free, use_tqdm=False)
    (masked,) = llm.chat([ASK], constrained_params, use_tqdm=False)
    top = lambda out: {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}  # noqa: E731
    # (The constrained entry also holds its own token, which the grammar chose; approximately equal: the
    # second run's prompt comes from the prefix cache, by another attention path.)
    plain_top, masked_top = top(plain), top(masked)
    assert {t: masked_top.get(t) for t in plain_top} == pytest.approx(plain_top, abs=1e-3)


def test_free_requests_greedy_tokens_unchanged_by_constrained_neighbours(llm):
    free_prompts = ["The capital of France is", "Water boils at", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.generate(free_prompts, greedy, use_tqdm=False)
    mixed_params = [constrained(1, s, 64, json=PERSON) for s in (1, 2)] + [greedy] * 3
    mixed = llm.generate(["Employee:", "Person:"] + free_prompts, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[2:]] == [o.outputs[0].token_ids for o in alone]


def test_preemption_keeps_the_grammar_state(llm, default_model_dir):
    params = SamplingParams(temperature=0, max_tokens=128, structured_outputs=StructuredOutputsParams(json=PERSON))
    prompts = [[{"role": "user", "content": f"Describe employee number {i} as JSON."}] for i in range(3)]
    expected = llm.chat(prompts, params, use_tqdm=False)
    # 16 blocks of 16 tokens: each request (38 prompt tokens, ~95 of JSON) ends up needing 9 of them, so they
    # cannot all run at once: requests are preempted mid-JSON and resumed.
    small = LLM(str(default_model_dir), num_kv_blocks=16, max_num_batched_tokens=512)
    got = small.chat(prompts, params, use_tqdm=False)
    assert small.engine.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    for out in got:  # every greedy answer is complete within 128 tokens, and valid
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ({"regex": "(ab"}, "the regex cannot be compiled: Regex parsing error"),
        ({"grammar": "root ::= missing_rule"}, 'Rule "missing_rule" is not defined'),
        ({"json": {"type": "strng"}}, "the JSON schema cannot be compiled"),
        ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "'uniqueItems' at $"),
        (
            {"json": {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}}},
            "'multipleOf' at $.properties.n",
        ),
    ],
)
def test_bad_specs_are_refused_before_any_compute(llm, spec, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        llm.generate(
            ["x", "y"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False
        )
    engine = llm.engine
    assert not engine.has_unfinished_requests() and engine.structured.num_pending == 0
    assert (
        len(llm.generate("ok", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids)
        == 2
    )


def test_shape_errors_are_value_errors_at_construction():
    for kwargs, message in [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"choice": []}, "at least one"),
        ({"choice": ["a", ""]}, "non-empty"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": "[1]"}, "JSON object"),
    ]:
        with pytest.raises(ValueError, match=message):
            StructuredOutputsParams(**kwargs)


def test_grammars_are_compiled_once_and_matchers_freed(llm):
    structured = llm.engine.structured
    spec = StructuredOutputsParams(
        json={"type": "object", "properties": {"once": {"type": "boolean"}}, "required": ["once"]}
    )
    before = structured.num_compiles
    llm.generate(
        ["a", "b", "c"], SamplingParams(temperature=1.0, seed=1, max_tokens=16, structured_outputs=spec), use_tqdm=False
    )
    llm.generate("d", SamplingParams(max_tokens=16, structured_outputs=spec), use_tqdm=False)
    assert structured.num_compiles == before + 1
    bad = StructuredOutputsParams(regex="[z-a]")
    for _ in range(2):
        with pytest.raises(ValueError):
            llm.generate("e", SamplingParams(structured_outputs=bad), use_tqdm=False)
    assert structured.num_compiles == before + 1  # a refusal is cached too

    engine = llm.engine
    engine.add_request(
        "held",
        [1, 2, 3],
        SamplingParams(
            max_tokens=8,
            structured_outputs=StructuredOutputsParams(
                json={"type": "object", "properties": {"fresh_key_1": {"type": "integer"}}}
            ),
        ),
    )
    assert engine.abort_request("held") and not engine.has_unfinished_requests()  # aborted while compiling
    engine.add_request("kept", [1, 2, 3], SamplingParams(max_tokens=50, structured_outputs=spec))
    engine.step()
    request = engine.scheduler.requests["kept"]
    assert request.grammar is not None
    engine.abort_request("kept")
    assert request.grammar is None  # finishing (here: aborting) drops the matcher at once


def test_the_start_up_load_runs_at_the_lowest_priority_and_a_request_need_not_wait_for_it(default_model_dir):
    """The server starts the backend's load once it is ready, at the lowest priority (so that the first
    requests keep both cores); a constrained request sent at once is compiled all the same."""
    fresh = LLM(str(default_model_dir), kv_cache_memory="128MiB")
    structured = fresh.engine.structured
    structured.start()
    out = fresh.generate("x", constrained(1, seed=3, max_tokens=24, choice=["yes", "no"]), use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no")
    assert structured.loader is not None
    structured.loader.join(60)
    assert structured.load_niceness == LOAD_NICENESS
    assert structured.backend() is structured.backend()  # one backend, whichever thread loaded it


def test_the_start_up_load_begins_only_once_what_it_waits_for_is_done(default_model_dir, monkeypatch):
    """The server has the load wait for the KV pool's pages (engine_core/core_proc.py)."""
    fresh = LLM(str(default_model_dir), kv_cache_memory="128MiB")
    structured = fresh.engine.structured
    gate, waited, waited_when_built = threading.Event(), threading.Event(), []

    def after():
        gate.wait(60)
        waited.set()

    def backend(*args):
        waited_when_built.append(waited.is_set())
        return real_backend(*args)

    real_backend = structured_output.GrammarBackend
    monkeypatch.setattr(structured_output, "GrammarBackend", backend)
    structured.start(after=after)
    assert structured.loader is not None and structured.loader.is_alive()
    gate.set()
    structured.loader.join(60)
    assert waited_when_built == [True] and structured.backend() is not None


@pytest.mark.parametrize("option", [{"min_tokens": 20}, {"ignore_eos": True}])
def test_min_tokens_and_ignore_eos_yield_to_the_grammar(llm, option):
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=30,
        **option,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    out = llm.generate("Answer:", params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop" and out.token_ids[-1] == EOS


def test_unsupported_keywords_are_found_where_they_are():
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "string"},  # a property named like a keyword is not the keyword
            "list": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"not": {"const": 1}}]}},
        },
    }
    assert unsupported_feature(schema) == "'not' at $.properties.list.items.anyOf[1]"
    assert unsupported_feature({"$defs": {"x": {"if": {}}}, "$ref": "#/$defs/x"}) == "'if' at $.$defs.x"
    assert unsupported_feature({"allOf": [{"type": "integer"}]}) is None
    assert unsupported_feature({"type": "integer", "multipleOf": 3}) is None
    assert unsupported_feature({"type": "string", "format": "idn-email"}) == "format 'idn-email' at $"
    assert unsupported_feature(PERSON) is None


@pytest.mark.parametrize(
    "schema, violating",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
        ({"not": {"type": "string"}}, '"a"'),
        ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, "9"),
        ({"type": "number", "multipleOf": 2}, "3"),
        ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}, "minContains": 2}, "[3, 1]"),
        (
            {
                "allOf": [
                    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
                ]
            },
            '{"a": 1}',
        ),
        ({"type": "string", "format": "idn-email"}, '"~ ~"'),
        ({"type": "string", "format": "regex"}, '"("'),
    ],
)
def test_refused_keywords_are_ones_the_backend_lets_through(llm, schema, violating):
    """Why json_schema_support refuses them: compiled anyway, xgrammar accepts a violating value. If
    this fails after an xgrammar upgrade, the keyword is enforced now and can leave the list."""
    backend = llm.engine.structured.backend()
    matcher = backend.matcher(backend.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
    assert matcher.accept_string(violating) and matcher.is_completed()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(violating), schema, format_checker=jsonschema.FormatChecker())
