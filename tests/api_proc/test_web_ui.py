"""The built-in web app in a real browser (Playwright driving Debian's Chromium, tests/browser.py),
against a real `pagoda serve` on SmolLM2: the playground's streamed reply is the API's greedy answer,
Stop aborts the request, constraints and tools reach the model, the copied curl / Python snippets run,
the page refuses to work without a key when the server has keys, it works behind a proxy at a
sub-path, and the dashboard's numbers move under `pagoda bench serve` and match /metrics within one
refresh. Screenshots of both pages are saved (PAGODA_SCREENSHOT_DIR, default: the test's tmp dir;
docs/images/ holds the README's).

Every page loads under the server's Content-Security-Policy; no test here may see a script error."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from playwright.sync_api import sync_playwright

from pagoda.api_proc.bench.local_server import MODEL_NAME, http
from tests.browser import launch, wait_for
from tests.metrics_scrape import Scrape, delta, scrape_until
from tests.sub_path_proxy import SubPathProxy

VIEWPORT = {"width": 1280, "height": 860}
USER_KEY = "user-key-for-the-web-ui"
ADMIN_KEY = "admin-key-for-the-web-ui"
SYSTEM = "You are a helpful assistant. Answer in one sentence."
QUESTION = "What is the capital of France?"
PHONE = r"[0-9]{3}-[0-9]{4}"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# The cards whose value is a /metrics sample summed over replicas (data-sample), by card id.
COUNTER_CARDS = ["preemptions", "prompt_tokens", "generation_tokens", "requests"]


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        chromium = launch(playwright)  # fails (never skips) when Chromium cannot be installed or started
        yield chromium
        chromium.close()


class Tab:
    """A page of the app in a fresh browser context (its own sessionStorage), recording script errors."""

    def __init__(self, browser, url: str, permissions: list[str] | None = None):
        self.context = browser.new_context(viewport=VIEWPORT, permissions=permissions or [])
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.failed_loads: list[str] = []
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("console", self._console)
        self.page.goto(url)

    def _console(self, message) -> None:
        if message.type != "error":
            return
        # A refused request (401 without a key) is logged by the browser itself; anything else is a fault.
        (self.failed_loads if "Failed to load resource" in message.text else self.errors).append(message.text)

    def close(self) -> None:
        self.context.close()
        assert not self.errors, self.errors

    # ---- the playground ------------------------------------------------------------------------------
    def settings(self, **values) -> None:
        for name, value in values.items():
            self.page.fill(f"#{name}", str(value))

    def constraint(self, kind: str, spec: str) -> None:
        self.page.select_option("#constraint-kind", kind)
        self.page.fill("#constraint", spec)

    def send(self, text: str):
        """Send `text`; the reply's element once it has ended (done, stopped or failed)."""
        before = self.page.locator(".msg.assistant").count()
        self.page.fill("#prompt", text)
        self.page.click("#send")
        reply = self.page.locator(".msg.assistant").nth(before)
        wait_for(lambda: reply.get_attribute("data-state") != "streaming", 120, "the reply to end")
        return reply

    def content(self, reply) -> str:
        return reply.locator(".content").text_content()

    # ---- the dashboard -------------------------------------------------------------------------------
    def refreshes(self) -> int:
        return int(self.page.get_attribute("#dashboard", "data-refreshes") or 0)

    def cards(self) -> dict:
        """Every card's raw value (data-value) and the refresh it belongs to, read at one moment."""
        return self.page.evaluate(
            """() => ({
                refreshes: Number(document.getElementById("dashboard").dataset.refreshes || 0),
                values: Object.fromEntries([...document.querySelectorAll(".card")].map(
                    (c) => [c.dataset.card, c.dataset.value === "" ? null : Number(c.dataset.value)])),
                samples: Object.fromEntries([...document.querySelectorAll(".card[data-sample]")].map(
                    (c) => [c.dataset.card, c.dataset.sample])),
            })"""
        )

    def card(self, name: str) -> float | None:
        return self.cards()["values"][name]

    def fresh_cards(self) -> dict:
        """Cards from a poll that began after this call: two refreshes on (the next one's request may
        have gone out already)."""
        start = self.refreshes()
        return wait_for(lambda: (c := self.cards())["refreshes"] >= start + 2 and c, 30, "two dashboard refreshes")

    def screenshot(self, name: str, tmp_path: Path) -> Path:
        folder = Path(os.environ.get("PAGODA_SCREENSHOT_DIR") or tmp_path)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        self.page.screenshot(path=str(path), full_page=True)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
        return path


@pytest.fixture
def tab(browser, server):
    opened = Tab(browser, server.base_url + "/")
    wait_for(lambda: opened.page.get_attribute("body", "data-connected") == "true", 30, "the model list")
    yield opened
    opened.close()


def ask(client, user: str, max_tokens: int, system: str | None = None, **extra):
    """The API's greedy reply message to `user` (after `system`, if given)."""
    return greedy(client, user, max_tokens, system, **extra).choices[0].message


def greedy(client, user: str, max_tokens: int, system: str | None = None, **extra):
    messages = [{"role": "system", "content": system}] if system else []
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages + [{"role": "user", "content": user}],
        temperature=0,
        max_tokens=max_tokens,
        **extra,
    )


def test_the_streamed_reply_is_the_api_greedy_answer_with_its_numbers(tab, client, tmp_path):
    tab.settings(system=SYSTEM, temperature=0, max_tokens=48, seed=5)
    reply = tab.send(QUESTION)
    expected = greedy(client, QUESTION, 48, SYSTEM, seed=5)
    assert reply.get_attribute("data-state") == "done"
    assert tab.content(reply) == expected.choices[0].message.content
    assert reply.get_attribute("data-finish-reason") == expected.choices[0].finish_reason
    assert int(reply.get_attribute("data-prompt-tokens")) == expected.usage.prompt_tokens
    assert int(reply.get_attribute("data-completion-tokens")) == expected.usage.completion_tokens
    meta = reply.locator(".meta").text_content()
    assert f"{expected.usage.completion_tokens} completion tokens" in meta
    assert "TTFT" in meta and "tok/s" in meta, meta
    # The next turn carries the conversation: the same answer as the API given the same history.
    follow_up = "And of Italy?"
    second = tab.send(follow_up)
    history = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": expected.choices[0].message.content},
        {"role": "user", "content": follow_up},
    ]
    again = client.chat.completions.create(model=MODEL_NAME, messages=history, temperature=0, max_tokens=48, seed=5)
    assert tab.content(second) == again.choices[0].message.content
    tab.screenshot("playground.png", tmp_path)


def test_stop_aborts_the_request_and_the_dashboard_running_count_returns_to_zero(browser, server, tab):
    dashboard = Tab(browser, server.base_url + "/#dashboard")
    try:
        before = Scrape(server)
        tab.settings(temperature=0, max_tokens=2000)
        tab.page.fill("#prompt", "Write a very long story about a dragon who learns to fly.")
        tab.page.click("#send")
        reply = tab.page.locator(".msg.assistant").last
        wait_for(lambda: len(tab.content(reply)) > 20, 120, "the story to start")
        wait_for(lambda: dashboard.card("running") == 1, 30, "the dashboard to show it running")
        tab.page.click("#stop-button")
        wait_for(lambda: reply.get_attribute("data-state") == "stopped", 30, "the reply to stop")
        assert "stopped" in reply.locator(".meta").text_content()
        assert tab.page.is_enabled("#send") and not tab.page.is_enabled("#stop-button")
        wait_for(lambda: dashboard.card("running") == 0, 30, "the dashboard's running count back to 0")
        after = scrape_until(server, lambda s: s.value("vllm:num_requests_running") == 0)
        assert delta(before, after, "pagoda:request_aborted_total") == 1
        assert delta(before, after, "vllm:request_success_total", finished_reason="abort") == 1
        assert delta(before, after, "vllm:generation_tokens_total") < 2000
        wait_for(lambda: dashboard.card("aborted") == after.value("pagoda:request_aborted_total"), 30, "aborted")
    finally:
        dashboard.close()


def test_a_json_schema_constraint_gives_valid_json_in_the_page(tab, client):
    tab.settings(temperature=0, max_tokens=80)
    tab.constraint("json_schema", json.dumps(PERSON))
    reply = tab.send("Describe a person as JSON.")
    assert reply.get_attribute("data-finish-reason") == "stop"
    jsonschema.validate(json.loads(tab.content(reply)), PERSON)


def test_regex_and_choice_constraints_and_tools_reach_the_model(tab, client):
    tab.settings(temperature=0, max_tokens=20)
    tab.constraint("regex", PHONE)
    phone = tab.content(tab.send("Give me a phone number."))
    assert re.fullmatch(PHONE, phone)
    assert phone == ask(client, "Give me a phone number.", 20, extra_body={"guided_regex": PHONE}).content
    tab.page.click("#clear")
    tab.constraint("choice", "yes\nno")
    assert tab.content(tab.send("Is Paris in France?")) in ("yes", "no")
    tab.page.click("#clear")
    tab.page.select_option("#constraint-kind", "")
    tab.page.fill("#tools", json.dumps([WEATHER_TOOL]))
    tab.page.select_option("#tool_choice", "required")
    reply = tab.send("What is the weather in Paris?")
    expected = ask(client, "What is the weather in Paris?", 20, tools=[WEATHER_TOOL], tool_choice="required")
    call = expected.tool_calls[0].function
    assert reply.locator(".tool-call").text_content() == f"{call.name}({call.arguments})"


def test_the_copied_curl_and_python_snippets_run_and_give_the_same_answer(browser, server, client):
    tab = Tab(browser, server.base_url + "/", permissions=["clipboard-read", "clipboard-write"])
    try:
        wait_for(lambda: tab.page.get_attribute("body", "data-connected") == "true", 30, "the model list")
        tab.settings(system=SYSTEM, temperature=0, max_tokens=24, seed=3, stop=".")
        tab.page.fill("#prompt", QUESTION)  # the snippet asks what Send would (not sent here)
        expected = ask(client, QUESTION, 24, SYSTEM, seed=3, stop=["."]).content
        snippets = {}
        for button in ("#copy-curl", "#copy-python"):
            tab.page.click(button)
            snippets[button] = tab.page.text_content("#code-text")
            tab.page.click("#code-copy")
            wait_for(lambda: tab.page.text_content("#code-copied") == "copied", 10, "the copy")
            assert tab.page.evaluate("navigator.clipboard.readText()") == snippets[button]
            tab.page.click("#code-close")
        curl = subprocess.run(["bash", "-c", snippets["#copy-curl"]], capture_output=True, text=True, timeout=120)
        assert json.loads(curl.stdout)["choices"][0]["message"]["content"] == expected, curl.stderr
        python = subprocess.run(
            [sys.executable, "-c", snippets["#copy-python"]], capture_output=True, text=True, timeout=120
        )
        assert f"content={expected!r}" in python.stdout, python.stdout + python.stderr
    finally:
        tab.close()


@pytest.fixture(scope="module")
def keyed_server(start_server):
    return start_server("--api-key", USER_KEY, "--admin-key", ADMIN_KEY)


def test_with_keys_the_page_refuses_to_work_without_a_key(browser, keyed_server):
    base = keyed_server.base_url
    assert http("GET", base + "/")[0] == 200  # the page itself is public: it must load to ask for a key
    assert http("GET", base + "/dashboard.json")[0] == 401
    tab = Tab(browser, base + "/")
    page = tab.page
    dialog = page.locator("#key-dialog")

    def asks(reason: str) -> bool:
        return dialog.get_attribute("open") is not None and reason in (page.text_content("#key-reason") or "")

    try:
        wait_for(lambda: asks("API key"), 30, "the page to ask for a key")
        page.click("#key-dialog button[value=cancel]")
        assert "needs an API key" in page.text_content("#banner")
        refused = tab.send(QUESTION)
        assert refused.get_attribute("data-state") == "error"
        assert "API key" in refused.locator(".error").text_content()
        wait_for(lambda: asks("API key"), 30, "the page to ask again")
        page.click("#key-dialog button[value=cancel]")
        page.click("#tab-dashboard")
        wait_for(lambda: "needs an API key" in page.text_content("#dash-status"), 30, "the dashboard to refuse")
        assert tab.refreshes() == 0
        page.click("#key-button")
        page.fill("#key-input", "not-the-right-key")
        page.click("#key-ok")
        wait_for(lambda: asks("Incorrect API key"), 30, "a wrong key to be refused")
        page.fill("#key-input", USER_KEY)
        page.click("#key-ok")
        wait_for(lambda: page.get_attribute("body", "data-connected") == "true", 30, "the key to be taken")
        wait_for(lambda: tab.refreshes() >= 1, 30, "the dashboard to work with the key")
        # Kept for this tab's session only.
        assert page.evaluate("sessionStorage.getItem('pagoda.apiKey')") == USER_KEY
        assert page.evaluate("localStorage.length") == 0
        # The admin action needs the admin key: a user key is refused, the admin key works.
        page.click("#reset-prefix-cache")
        wait_for(lambda: asks("admin key"), 30, "the page to ask for the admin key")
        page.fill("#key-input", USER_KEY)
        page.click("#key-ok")
        wait_for(lambda: "needs the admin key" in page.text_content("#admin-result"), 30, "a user key refused")
        page.click("#reset-prefix-cache")
        wait_for(lambda: asks("admin key"), 30, "the page to ask for the admin key again")
        page.fill("#key-input", ADMIN_KEY)
        page.click("#key-ok")
        wait_for(lambda: "prefix cache reset" in page.text_content("#admin-result"), 30, "the reset")
        page.click("#tab-playground")
        assert tab.send(QUESTION).get_attribute("data-state") == "done"
        assert tab.failed_loads  # the refusals above were real 401/403 answers, which the browser logs
    finally:
        tab.close()
    again = Tab(browser, base + "/")  # a new browser session has no key
    try:
        wait_for(lambda: again.page.get_attribute("#key-dialog", "open") is not None, 30, "a new session to ask")
    finally:
        again.close()


def test_the_app_works_behind_a_reverse_proxy_at_a_sub_path(browser, server, client):
    with SubPathProxy(server.base_url, "/llm/") as proxy:
        tab = Tab(browser, proxy.url)
        try:
            wait_for(lambda: tab.page.get_attribute("body", "data-connected") == "true", 30, "the model list")
            tab.settings(system=SYSTEM, temperature=0, max_tokens=24)
            assert tab.content(tab.send(QUESTION)) == ask(client, QUESTION, 24, SYSTEM).content
            tab.page.click("#copy-curl")
            assert proxy.url + "v1/chat/completions" in tab.page.text_content("#code-text")
            tab.page.click("#code-close")
            tab.page.click("#tab-dashboard")
            wait_for(lambda: tab.refreshes() >= 2, 30, "the dashboard through the proxy")
        finally:
            tab.close()
    assert proxy.outside_paths == []


@pytest.mark.slow
def test_the_dashboard_moves_under_load_and_matches_metrics_within_one_refresh(browser, server, tmp_path):
    dashboard = Tab(browser, server.base_url + "/#dashboard")
    result_file = tmp_path / "bench.json"
    bench = None
    try:
        first = dashboard.fresh_cards()
        bench = subprocess.Popen(
            [sys.executable, "-m", "pagoda.api_proc.cli", "bench", "serve", "--base-url", server.base_url]
            + ["--dataset-name", "prefix", "--prefix-len", "64", "--input-len", "16", "--output-len", "32"]
            + ["--num-prompts", "24", "--max-concurrency", "4", "--no-progress", "--save-result", str(result_file)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        seen = []
        while bench.poll() is None:
            before = Scrape(server)
            cards = dashboard.fresh_cards()  # polled after `before`, read before `after`
            after = Scrape(server)
            for card in COUNTER_CARDS:
                name = cards["samples"][card]
                assert before.value(name) <= cards["values"][card] <= after.value(name), (card, cards)
            seen.append(cards["values"])
            if len(seen) == 3:  # the chart has a few seconds of load in it by now
                dashboard.screenshot("dashboard.png", tmp_path)
        output = bench.communicate()[0]
        assert bench.returncode == 0, output
        assert len(seen) >= 2, "the benchmark ended before the dashboard refreshed twice"
        assert max(v["running"] for v in seen) >= 1
        assert max(v["generation_rate"] for v in seen) > 0
        assert seen[-1]["generation_tokens"] > seen[0]["generation_tokens"]
        # Idle again: every card is exactly what /metrics says.
        scrape_until(server, lambda s: s.value("vllm:num_requests_running") == 0)
        final = dashboard.fresh_cards()
        metrics = Scrape(server)
        for card, name in final["samples"].items():
            assert final["values"][card] == metrics.value(name), card
        assert final["values"]["kv_cache_usage"] == metrics.value("vllm:kv_cache_usage_perc")
        hits, queries = metrics.value("vllm:prefix_cache_hits_total"), metrics.value("vllm:prefix_cache_queries_total")
        assert final["values"]["prefix_hit_rate"] == pytest.approx(hits / queries) and hits > 0
        summary = json.loads(result_file.read_text())["summary"]
        assert summary["completed"] == 24
        generated = final["values"]["generation_tokens"] - first["values"]["generation_tokens"]
        assert generated == summary["output_tokens"]
    finally:
        if bench is not None and bench.poll() is None:
            bench.kill()
            bench.wait()
        dashboard.close()
