"""The Grafana dashboard (deploy/grafana/kvpool.json) queries only series the code exports, with
their labels and label values; the vLLM series it uses besides are checked on a live instance
(tests/vllm/test_mixed_routing.py)."""

from __future__ import annotations

import json
from pathlib import Path

from kvpool.metrics import catalog
from kvpool.testing.metrics import dashboard_exprs, dashboard_problems

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvpool.json"
# vLLM's own series the dashboard shows next to kvpool's.
VLLM_OWN = {"vllm:time_to_first_token_seconds_bucket"}


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_names_only_exported_series():
    problems, foreign = dashboard_problems(load(), catalog.ALL)
    assert problems == []
    assert foreign == VLLM_OWN


def test_the_checker_finds_a_wrong_name_label_or_value():
    bad = {"panels": [{"targets": [
        {"expr": "rate(kvpool_read_hit_total[5m])"},
        {"expr": 'sum by (tier) (rate(kvpool_puts_total[5m]))'},
        {"expr": 'rate(vllm:kvpool_blocks_total{op="copy"}[5m])'},
        {"expr": 'rate(vllm:kvpool_lookups_total{tier="disk"}[5m])'}]}]}
    problems, _ = dashboard_problems(bad, catalog.ALL)
    assert len(problems) == 4, problems


def test_every_component_and_every_issue_topic_has_a_panel():
    text = " ".join(dashboard_exprs(load()))
    for needed in ("kvpool_read_hits_total", "kvpool_memory_used_bytes", "kvpool_disk_used_bytes",
                   "kvpool_evictions_total", "kvpool_request_duration_seconds_bucket",
                   "vllm:kvpool_transferred_bytes_total", "vllm:kvpool_transfer_seconds_bucket",
                   "vllm:kvpool_failures_total", "vllm:kvpool_prompt_tokens_total",
                   "kvpool_proxy_routed_requests_total", "kvpool_proxy_requests_total"):
        assert needed in text, needed
    panels = [p for p in load()["panels"] if p["type"] != "row"]
    assert all(p["title"] and p["description"] and p["datasource"]["uid"] == "${datasource}" for p in panels)
