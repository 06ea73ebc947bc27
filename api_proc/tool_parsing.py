"""The model's output back into OpenAI's `tool_calls`, whole or streamed (plans: api_proc/tools.py).

Streaming and non-streaming run the same code (`ToolCallStream`): a whole response is one stream fed
all its text at once, so both agree call for call, argument for argument.

- Forced calls (`required`, named) are constrained JSON. A named call's output *is* the arguments,
  streamed as they come. A `required` output, `[{"name": "f", "arguments": {...}}, ...]`, goes
  through `CallArrayScanner`, which emits each call's name once its string is complete and its
  arguments text as it arrives.
- `auto`: text that starts (after whitespace) with `<tool_call>` is held back until the end and
  parsed then; if it parses into calls of known tools it becomes `tool_calls`, otherwise it is sent
  as content after all. Other text streams as content at once (only a possible prefix of the tag is
  held back).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pagoda.api_proc.tools import ToolPlan

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallArrayScanner:
    """Reads `[{"name": "...", "arguments": {...}}, ...]` a piece at a time (key order as the schema
    forces it: name first). Tracks strings and nesting depth character by character."""

    def __init__(self):
        self.depth = 0
        self.in_string = self.escaped = False
        self.expect_key = False  # at depth 2: the next string is a key
        self.key: str | None = None
        self.string: list[str] = []  # raw text of a depth-2 string being read
        self.call = -1  # index of the call being read
        self.in_arguments = False

    def feed(self, text: str) -> list[tuple[str, int, str]]:
        """Events for this text: ("name", call index, name) and ("arguments", call index, fragment)."""
        events: list[tuple[str, int, str]] = []
        arguments: list[str] = []
        for char in text:
            if self.in_arguments:
                arguments.append(char)
            if self.in_string:
                self._string_char(char, events)
                continue
            if char == '"':
                self.in_string, self.string = True, []
            elif char in "{[":
                self.depth += 1
                if self.depth == 2:
                    self.call, self.expect_key = self.call + 1, True
                elif self.depth == 3 and self.key == "arguments" and not self.in_arguments:
                    self.in_arguments = True
                    arguments.append(char)
            elif char in "}]":
                self.depth -= 1
                if self.in_arguments and self.depth == 2:
                    self.in_arguments = False
                    events.append(("arguments", self.call, "".join(arguments)))
                    arguments = []
            elif self.depth == 2 and char in ":,":
                self.expect_key = char == ","
        if arguments:
            events.append(("arguments", self.call, "".join(arguments)))
        return events

    def _string_char(self, char: str, events: list) -> None:
        if self.escaped:
            self.escaped = False
        elif char == "\\":
            self.escaped = True
        elif char == '"':
            self.in_string = False
            if self.depth == 2:
                value = json.loads('"' + "".join(self.string) + '"')
                if self.expect_key:
                    self.key = value
                elif self.key == "name":
                    events.append(("name", self.call, value))
            return
        if self.depth == 2:
            self.string.append(char)


def parse_tagged_calls(text: str, plan: ToolPlan) -> list[tuple[str, str]] | None:
    """`<tool_call>[...]</tool_call>` (or one call object inside the tags) as (name, arguments JSON),
    or None if `text` is not exactly that with known tool names and object arguments."""
    body = text.strip()
    if not body.startswith(_OPEN):
        return None
    body = body[len(_OPEN) :]
    if _CLOSE in body:
        body, rest = body.split(_CLOSE, 1)
        if rest.strip():
            return None
    try:
        calls = json.loads(body)
    except ValueError:
        return None
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for call in calls:
        if not isinstance(call, dict) or call.get("name") not in plan.names:
            return None
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models send the arguments JSON as a string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        out.append((call["name"], json.dumps(arguments, ensure_ascii=False)))
    return out if plan.parallel else out[:1]


class ToolCallStream:
    """One sample's output under a tool plan, as OpenAI chat deltas: `step(text, reason)` for each
    piece of text (`reason`: the finish reason on the last piece) returns the delta to send (a dict,
    maybe empty) and the OpenAI finish_reason ("tool_calls" once calls were made and it stopped)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.ids: list[str] = []  # one per call started
        self.scanner = CallArrayScanner() if plan.mode == "required" else None
        self.held = ""  # auto: text that may still be a tool call
        self.content_mode = False  # auto: decided it is plain content

    def step(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        delta = self._feed(text)
        if reason is None:
            return delta, None
        last, reason = self._finish(reason)
        for key, value in last.items():  # (only one of the two is non-empty in practice)
            delta[key] = delta.get(key, type(value)()) + value
        return delta, reason

    def _feed(self, text: str) -> dict[str, Any]:
        if self.plan.mode == "named":  # the output is the arguments; the name goes out first
            events = [] if self.ids else [("name", 0, self.plan.named)]
            return self._calls_delta(events + [("arguments", 0, text)])
        if self.scanner is not None:
            return self._calls_delta(self.scanner.feed(text))
        if self.content_mode:
            return {"content": text} if text else {}
        self.held += text
        stripped = self.held.lstrip()
        if stripped.startswith(_OPEN) or _OPEN.startswith(stripped):
            return {}  # a tool call, or maybe one: wait
        self.content_mode, text, self.held = True, self.held, ""
        return {"content": text}

    def _finish(self, reason: str) -> tuple[dict[str, Any], str]:
        delta: dict[str, Any] = {}
        if self.plan.mode == "auto" and not self.content_mode and self.held:
            calls = parse_tagged_calls(self.held, self.plan)
            if calls is None:
                delta = {"content": self.held}
            else:
                events = [
                    event
                    for i, (name, args) in enumerate(calls)
                    for event in (("name", i, name), ("arguments", i, args))
                ]
                delta = self._calls_delta(events)
            self.held = ""
        if self.ids and reason == "stop":
            reason = "tool_calls"
        return delta, reason

    def _calls_delta(self, events: list[tuple[str, int, str]]) -> dict[str, Any]:
        """Events merged into one `tool_calls` delta: one entry per call, its id/type/name first."""
        entries: dict[int, dict[str, Any]] = {}
        for kind, index, value in events:
            entry = entries.setdefault(index, {"index": index, "function": {}})
            if kind == "name":
                self.ids.append(new_call_id())
                entry.update(id=self.ids[index], type="function")
                entry["function"]["name"] = value
                entry["function"].setdefault("arguments", "")
            elif value:
                entry["function"]["arguments"] = entry["function"].get("arguments", "") + value
        entries = {i: e for i, e in entries.items() if e["function"]}
        return {"tool_calls": [entries[i] for i in sorted(entries)]} if entries else {}


def tool_response(plan: ToolPlan, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole (non-streamed) output as the assistant message and its finish_reason: the stream's
    single delta, which then holds every call complete."""
    delta, reason = ToolCallStream(plan).step(text, reason)
    if not delta.get("tool_calls"):
        return {"role": "assistant", "content": delta.get("content", "")}, reason
    calls = [{"id": e["id"], "type": "function", "function": e["function"]} for e in delta["tool_calls"]]
    return {"role": "assistant", "content": delta.get("content"), "tool_calls": calls}, reason
