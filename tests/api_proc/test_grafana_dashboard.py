"""deploy/grafana/pagoda.json names only series a live Pagoda exports: every PromQL expression in it (panel
targets and template-variable queries) is parsed with a real PromQL parser (promql-parser), every metric it
selects must be in a running server's /metrics (started with speculative decoding, so vllm:spec_decode_*
exist; histograms export _bucket/_sum/_count), and every label it matches on must be one of that metric's
labels (or one Prometheus adds when it scrapes)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.api_proc.bench.local_server import http

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pagoda.json"
# Grafana's variables, replaced by values of their kind before parsing.
VARIABLES = {"$__rate_interval": "1m", "$model_name": ".*", "$engine": ".*", "$instance": ".*"}
SCRAPE_LABELS = {"instance", "job"}  # Prometheus adds these to every series it scrapes
LABEL_VALUES = re.compile(r"label_values\((?P<selector>.*),\s*(?P<label>[a-zA-Z_]\w*)\)")


def selectors(expr) -> list[tuple[str, set[str]]]:
    """(metric name, label names matched) of every vector selector in a parsed expression."""
    if isinstance(expr, promql_parser.VectorSelector):
        labels = {m.name for m in expr.matchers.matchers} | {m.name for ms in expr.matchers.or_matchers for m in ms}
        name = expr.name or next(m.value for m in expr.matchers.matchers if m.name == "__name__")
        return [(name, labels - {"__name__"})]
    if isinstance(expr, promql_parser.MatrixSelector):
        return selectors(expr.vector_selector)
    if isinstance(expr, promql_parser.Call):
        return [s for arg in expr.args for s in selectors(arg)]
    if isinstance(expr, promql_parser.BinaryExpr):
        return selectors(expr.lhs) + selectors(expr.rhs)
    if isinstance(expr, promql_parser.AggregateExpr):
        return selectors(expr.expr) + (selectors(expr.param) if expr.param is not None else [])
    if isinstance(expr, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
        return selectors(expr.expr)
    if isinstance(expr, (promql_parser.NumberLiteral, promql_parser.StringLiteral)):
        return []
    raise TypeError(f"a PromQL node this walker does not know: {type(expr).__name__}")


def substituted(expr: str) -> str:
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a Grafana variable without a test value in {expr!r}"
    return expr


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every query in the dashboard; label_values(SELECTOR, LABEL) as SELECTOR."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queries.append((f"panel {panel['title']!r}", substituted(target["expr"])))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = LABEL_VALUES.fullmatch(variable["definition"])
            assert match, variable["definition"]
            queries.append((f"variable {variable['name']}", substituted(match["selector"])))
    return queries


def used_series() -> dict[str, set[str]]:
    """Metric name -> label names matched on, over the whole dashboard (every expression parsed)."""
    used: dict[str, set[str]] = {}
    for _, expr in dashboard_queries():
        for name, labels in selectors(promql_parser.parse(expr)):
            used.setdefault(name, set()).update(labels)
    return used


def test_the_walker_finds_every_selector():
    expr = promql_parser.parse(
        'histogram_quantile(0.9, sum by (le) (rate(a_bucket{x="1"}[1m]))) / ignoring(p) group_left() '
        '(1 + -b) + max_over_time(c[5m:1m]) + {__name__="d", y=~".*"}'
    )
    assert sorted(selectors(expr)) == [("a_bucket", {"x"}), ("b", set()), ("c", set()), ("d", {"y"})]


def test_the_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(panel["targets"] for panel in dashboard["panels"] if panel["type"] != "row")
    used = used_series()
    assert len(used) >= 25  # (the walker read every panel)
    assert {"vllm:spec_decode_num_accepted_tokens_total", "vllm:time_to_first_token_seconds_bucket"} <= set(used)
    assert any(name.startswith("pagoda:") for name in used)
    assert all("engine" in labels for name, labels in used.items() if name.startswith(("vllm:", "pagoda:engine")))


def exported(text: str) -> dict[str, set[str]]:
    """Series name -> its label names, from Prometheus text."""
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def cuda_only_series() -> dict[str, set[str]]:
    """What a CUDA engine exports besides (GPU memory): rendered by the real collector, as it would be."""
    from prometheus_client import CollectorRegistry, generate_latest

    from pagoda.detok_proc.metrics import DeviceMemoryCollector

    collector = DeviceMemoryCollector("m")
    collector.engines[0] = (1, 2)
    registry = CollectorRegistry()
    registry.register(collector)
    return exported(generate_latest(registry).decode())


@pytest.mark.slow
def test_every_metric_the_dashboard_names_is_exported_by_a_live_server(start_server):
    server = start_server("--speculative-config", json.dumps({"method": "ngram"}))
    status, _ = http("POST", server.base_url + "/v1/completions", {"prompt": "a b a b a b", "max_tokens": 8})
    assert status == 200
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as response:
        series = exported(response.read().decode())
    series |= cuda_only_series()
    for name, labels in used_series().items():
        assert name in series, f"the dashboard uses {name}, which the server does not export"
        assert labels <= series[name] | SCRAPE_LABELS, (name, labels - series[name])
