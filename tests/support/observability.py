"""The chart's dashboard and alert rules, read for tests: their queries and the metric names in them."""

import json
import re
from pathlib import Path

import helm_python as helm
import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "kvmesh"
DASHBOARD = CHART / "files" / "dashboard.json"
_NAME = re.compile(r"\b((?:kvmesh_|vllm:)[a-zA-Z0-9_:]+)")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]


def rule_groups(values: dict | None = None) -> list[dict]:
    """The PrometheusRule's groups as the chart renders them."""
    values = {"prometheusRule": {"enabled": True}, **(values or {})}
    rendered = helm.Chart.load(str(CHART)).render(values, name="llm", namespace="serving")
    (rule,) = [
        d
        for name, text in rendered.items()
        if name.endswith(".yaml")
        for d in yaml.safe_load_all(text)
        if d and d["kind"] == "PrometheusRule"
    ]
    return rule["spec"]["groups"]


def alert_queries() -> list[str]:
    return [r["expr"] for g in rule_groups() for r in g["rules"]]


def metric_names() -> set[str]:
    return {m for q in dashboard_queries() + alert_queries() for m in _NAME.findall(q)}
