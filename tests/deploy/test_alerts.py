"""The chart's alert rules, checked by Prometheus' own ``promtool test rules`` on recorded
series: each alert fires when its condition holds long enough, and not before or otherwise."""

import os
import shutil
import subprocess

import observability
import pytest
import yaml

M = 'model_name="m"'


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("KVMESH_REQUIRE_PROMTOOL"):
            raise RuntimeError("KVMESH_REQUIRE_PROMTOOL is set but promtool is not installed")
        pytest.skip("promtool not installed (apt-get install prometheus); CI runs this")
    return found


def expected(alert: str, labels: dict[str, str], groups: list[dict]) -> dict:
    """The alert as promtool reports it: its labels and its annotations with labels filled in."""
    (rule,) = [r for g in groups for r in g["rules"] if r.get("alert") == alert]
    annotations = {}
    for key, text in rule["annotations"].items():
        for name, value in labels.items():
            text = text.replace(f"{{{{ $labels.{name} }}}}", value)
        annotations[key] = text
    return {"exp_labels": {**labels, **rule["labels"]}, "exp_annotations": annotations}


def case(series: dict[str, str], alert: str, quiet_at: str, firing_at: str, labels: dict, groups) -> dict:
    return {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "alert_rule_test": [
            {"eval_time": quiet_at, "alertname": alert, "exp_alerts": []},
            {"eval_time": firing_at, "alertname": alert, "exp_alerts": [expected(alert, labels, groups)]},
        ],
    }


def test_alert_rules_fire_on_recorded_series(tmp_path):
    tool = promtool()
    groups = observability.rule_groups({"prometheusRule": {"enabled": True, "ttftP90Seconds": 2}})
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    ttft = "kvmesh_router_time_to_first_token_seconds_bucket"
    tests = [
        # replicas gone at minute 3: pending for 1m, firing from minute 4
        case(
            {f"kvmesh_router_live_replicas{{{M}}}": "2 2 2 0 0 0 0 0"},
            "KvmeshNoLiveReplica",
            "3m",
            "5m",
            {},
            groups,
        ),
        # one replica's index untrusted from minute 2 (for 2m): firing at 5m, with the replica named
        case(
            {
                f'kvmesh_router_replica_index_state{{{M},replica="r0",state="EXACT"}}': "1 1 0 0 0 0 0 0",
                f'kvmesh_router_replica_index_state{{{M},replica="r0",state="DEGRADED"}}': "0 0 1 1 1 1 1 1",
                f'kvmesh_router_replica_index_state{{{M},replica="r1",state="EXACT"}}': "1 1 1 1 1 1 1 1",
            },
            "KvmeshIndexDegraded",
            "3m",
            "5m",
            {"replica": "r0"},
            groups,
        ),
        case(
            {f"kvmesh_router_index_up{{{M}}}": "1 1 0 0 0 0 0"},
            "KvmeshIndexUnreachable",
            "2m",
            "4m",
            {},
            groups,
        ),
        # every first token between 1 and 5 s from minute 0: p90 ~4.6 s > 2 s, firing after 5m
        case(
            {
                f'{ttft}{{{M},le="1.0"}}': "0+0x20",
                f'{ttft}{{{M},le="5.0"}}': "0+10x20",
                f'{ttft}{{{M},le="+Inf"}}': "0+10x20",
            },
            "KvmeshSlowTimeToFirstToken",
            "4m",
            "12m",
            {},
            groups,
        ),
    ]
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests})
    )
    run = subprocess.run([tool, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_fast_ttft_raises_no_alert(tmp_path):
    tool = promtool()
    groups = observability.rule_groups({"prometheusRule": {"enabled": True, "ttftP90Seconds": 2}})
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    ttft = "kvmesh_router_time_to_first_token_seconds_bucket"
    series = {f'{ttft}{{{M},le="0.5"}}': "0+10x20", f'{ttft}{{{M},le="+Inf"}}': "0+10x20"}
    test = {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "alert_rule_test": [
            {"eval_time": "15m", "alertname": "KvmeshSlowTimeToFirstToken", "exp_alerts": []}
        ],
    }
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "tests": [test]}))
    run = subprocess.run([tool, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_dashboard_panel_follows_the_model_selector():
    """A release of several models: the dashboard's `model` variable (every model_name the
    routers export, "All" by default) filters every series of every panel."""
    import re

    (variable,) = [v for v in observability.dashboard()["templating"]["list"] if v["name"] == "model"]
    assert variable["query"]["query"] == "label_values(kvmesh_router_requests_total, model_name)"
    assert variable["includeAll"] and variable["multi"] and variable["allValue"] == ".+"
    selectors = 0
    for query in observability.dashboard_queries():
        for match in re.finditer(r"\b((?:kvmesh_|vllm:)[a-zA-Z0-9_:]+)(\{[^}]*\})?", query):
            assert (match.group(2) or "").startswith('{model_name=~"$model"'), (match.group(1), query)
            selectors += 1
    assert selectors >= 20
