"""The Helm chart rendered offline: Helm's own lint and golden renders, the values schema
and the chart's own validation failures, and kubernetes-validate on the core kinds."""

import os

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from helm_chart import (
    BAD_VALUES,
    CHART,
    CI_VALUES,
    CORE_KINDS,
    DEFAULT,
    FAILS,
    GOLDEN,
    KUBE_VERSIONS,
    SCHEMA,
    merge,
    values_of,
)

from kvmesh.router.policies import POLICIES


@pytest.mark.parametrize("kube", ["v1.27.0", "v1.33.0"])
@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_helm_lint_strict(values_file, kube):
    report = helm.lint(str(CHART), values_of(values_file), strict=True, kube_version=kube)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], problems


def test_chart_metadata(chart):
    meta = chart.metadata
    assert meta["kubeVersion"] == ">=1.27.0-0" and meta["apiVersion"] == "v2"


def test_golden_renders(rendered):
    path, docs = rendered
    text = yaml.safe_dump_all(docs, sort_keys=True)  # nothing random: compared as it is
    golden = GOLDEN / f"{path.stem}.yaml"
    if os.environ.get("KVMESH_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.is_file(), f"no golden file for {path.name}: run with KVMESH_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"{path.name} renders differently: review, then KVMESH_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_merged_values_satisfy_the_schema(chart, values_file):
    jsonschema.validate(chart.merge_values(values_of(values_file)), SCHEMA)


@pytest.mark.parametrize(("override", "needle"), BAD_VALUES, ids=[n.strip("/") for _, n in BAD_VALUES])
def test_schema_rejects_bad_values(chart, override, needle):
    values = merge(values_of(DEFAULT), override)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(chart.merge_values(values), SCHEMA)
    with pytest.raises(helm.HelmError) as err:  # and Helm refuses to render them
        chart.render(values, name="llm", namespace="serving")
    assert needle in str(err.value)


def test_the_schemas_policies_are_the_routers():
    """The chart offers exactly the policies the router has (``session`` went into ``prefix``)."""
    assert sorted(SCHEMA["properties"]["router"]["properties"]["policy"]["enum"]) == sorted(POLICIES)


@pytest.mark.parametrize(("override", "message"), FAILS, ids=[m for _, m in FAILS])
def test_every_validation_fail_fires(chart, override, message):
    with pytest.raises(helm.HelmError, match=message.replace(">", ".")):
        chart.render(merge(values_of(DEFAULT), override), name="llm", namespace="serving")


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_core_kinds_validate(rendered, kube):
    _, docs = rendered
    checked = 0
    for d in docs:
        if d["kind"] in CORE_KINDS:
            kubernetes_validate.validate(d, kube, strict=True)
            checked += 1
    assert checked >= 6
