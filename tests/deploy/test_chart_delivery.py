"""How the chart delivers models and runs them: the download at deploy time, gated repos,
pull secrets and priority, Ray's token, each model's worker group, vLLM models."""

import argparse
import json

import jsonschema
import pytest
from helm_chart import (
    CHART,
    SCHEMA,
    by_kind,
    config_map,
    container,
    kvmesh_pods,
    pods,
    render,
    secret_of,
    values_of,
)


def controller_configs(docs: list[dict]) -> list:
    """The cluster configs ``kvmesh up`` builds from the controller's arguments, one a model."""
    from kvmesh.cli.commands import up as up_command

    [ctrl] = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-controller")]
    parser = argparse.ArgumentParser()
    up_command.FLAGS.add_to(parser)
    args = ctrl["spec"]["template"]["spec"]["containers"][0]["args"]
    env = config_map(docs)["data"]  # in the pod's environment
    args = [*args[1:], f"--redis-url={env['KVMESH_REDIS_URL']}"]
    if not any(a.startswith("--model=") for a in args):  # one model: the ConfigMap names it
        args.append(f"--model={env['KVMESH_MODEL']}")
    return [config for (config,) in up_command.FLAGS.build_models(parser.parse_args(args))]


def test_the_model_is_downloaded_at_deploy_time_by_default(chart):
    docs = render(chart, {})
    specs = kvmesh_pods(docs)
    cm = config_map(docs)
    assert (
        cm["data"]["KVMESH_MODEL"] == "/models/Qwen--Qwen3-0.6B" and cm["data"]["KVMESH_BLOCK_SIZE"] == "auto"
    )
    worker = specs["ray-gpu"]
    [init] = worker["initContainers"]
    assert init["args"] == ["download-model", "Qwen/Qwen3-0.6B", "/models/Qwen--Qwen3-0.6B"]
    assert {"name": "model", "emptyDir": {"sizeLimit": "64Gi"}} in worker["volumes"]
    assert any(m["name"] == "model" and not m.get("readOnly") for m in init["volumeMounts"])
    assert any(m["name"] == "model" and m["readOnly"] for m in worker["containers"][0]["volumeMounts"])
    router = specs["llm-kvmesh-router"]
    [router_init] = router["initContainers"]
    assert router_init["args"][-1] == "--tokenizer-only"  # no shared model volume for the router
    assert {"name": "model", "emptyDir": {"sizeLimit": "1Gi"}} in router["volumes"]
    assert "initContainers" not in specs["llm-kvmesh-controller"]
    assert not any(v["name"] == "model" for v in specs["llm-kvmesh-controller"]["volumes"])
    assert "initContainers" not in specs["ray-head"]


def test_a_gated_repo_gets_its_token_and_a_shared_claim_downloads_once(chart):
    docs = render(chart, values_of(CHART / "ci" / "multi-gpu-values.yaml"))
    downloads = 0
    for owner, spec in kvmesh_pods(docs).items():
        for init in spec.get("initContainers", []):
            env = {e["name"]: e["value"] for e in init["env"]}
            assert "HF_TOKEN" not in env, owner
            assert secret_of(spec, init, env["HF_TOKEN_PATH"]) == ("hf-token", "token"), owner
            main_mounts = spec["containers"][0]["volumeMounts"]
            assert not any(m["name"] == "hf-token" for m in main_mounts), owner  # the init container's alone
            downloads += 1
    assert downloads == 3  # the router and both worker groups
    worker = kvmesh_pods(docs)["ray-h100"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "llama-models"}} in worker["volumes"]
    off = render(chart, values_of(CHART / "ci" / "secure-values.yaml"))  # download off: the claim has it
    assert not any("initContainers" in spec for spec in kvmesh_pods(off).values())


def test_every_pod_gets_pull_secrets_annotations_and_priority(chart):
    docs = render(chart, values_of(CHART / "ci" / "secure-values.yaml"))
    owners = [owner for owner, _, _ in pods(docs)]
    assert {"ray-head", "ray-gpu", "llm-kvmesh-router", "llm-kvmesh-controller", "llm-kvmesh-valkey"} <= set(
        owners
    )
    for owner, meta, spec in pods(docs):
        assert spec["imagePullSecrets"] == [{"name": "registry-creds"}], owner
        assert spec["priorityClassName"] == "high-priority", owner
        assert meta["annotations"]["team"] == "inference", owner


def test_ray_token_authentication_is_on_by_default(chart):
    """Ray's token reaches every Ray pod, the autoscaler and the controller as a file
    (RAY_AUTH_TOKEN_PATH, which Ray reads), made by the hook Job unless the user gives one."""
    docs = render(chart, {})
    assert not by_kind(docs, "Secret")
    [job] = by_kind(docs, "Job")
    assert "llm-kvmesh-ray-auth=auth_token" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    for owner, spec in kvmesh_pods(docs).items():
        c = spec["containers"][0]
        env = {e["name"]: e["value"] for e in c.get("env", [])}
        if owner.endswith("-router"):
            assert not any(n.startswith("RAY_") for n in env)  # the router never talks to Ray
            assert not any(v["name"] == "ray-auth" for v in spec["volumes"])
        else:
            assert env["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN" not in env, owner
            assert secret_of(spec, c, env["RAY_AUTH_TOKEN_PATH"]) == ("llm-kvmesh-ray-auth", "auth_token"), (
                owner
            )
    [ray] = by_kind(docs, "RayCluster")
    autoscaler = {e["name"]: e["value"] for e in ray["spec"]["autoscalerOptions"]["env"]}
    head, head_container = container(docs, "ray-head")
    [mount] = ray["spec"]["autoscalerOptions"]["volumeMounts"]  # a volume of the head pod's
    assert autoscaler == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/etc/kvmesh/ray/auth_token"}
    assert mount in head_container["volumeMounts"]
    assert secret_of(head, head_container, autoscaler["RAY_AUTH_TOKEN_PATH"]) == (
        "llm-kvmesh-ray-auth",
        "auth_token",
    )
    own = render(chart, {"ray": {"auth": {"existingSecret": "my-ray-token"}}})
    [job] = by_kind(own, "Job")
    assert not any("ray-auth" in a for a in job["spec"]["template"]["spec"]["containers"][0]["args"])
    spec, c = container(own, "llm-kvmesh-controller")
    assert secret_of(spec, c, "/etc/kvmesh/ray/auth_token") == ("my-ray-token", "auth_token")
    off = render(chart, {"ray": {"auth": {"enabled": False}}})
    for owner, spec in kvmesh_pods(off).items():
        assert not any(e["name"].startswith("RAY_") for e in spec["containers"][0].get("env", [])), owner
        assert not any(v["name"] == "ray-auth" for v in spec["volumes"]), owner
    assert "autoscalerOptions" not in by_kind(off, "RayCluster")[0]["spec"]


def test_subchart_and_naming_values(chart):
    values = {"global": {"imageRegistry": "x"}, "nameOverride": "llm-mesh", "podLabels": {"cost": "a"}}
    jsonschema.validate(chart.merge_values(values), SCHEMA)
    docs = render(chart, values)
    names = {d["metadata"]["name"] for d in docs}
    assert "llm-llm-mesh-router" in names and all(meta["labels"]["cost"] == "a" for _, meta, _ in pods(docs))
    docs = render(chart, {"fullnameOverride": "prod"})
    assert {"prod-router", "prod-controller", "prod"} <= {d["metadata"]["name"] for d in docs}


def test_each_model_has_its_worker_group_its_replicas_and_its_download(chart):
    """Two models: one worker group each (the template under its own keys) offering a Ray
    resource that only that model's replicas take, each group downloading its own model,
    the router pod fetching both tokenizers, and the controller's replicas of each model
    placed by that resource, as ``kvmesh up`` parses its arguments."""
    docs = render(chart, values_of(CHART / "ci" / "multi-model-values.yaml"))
    [ray] = by_kind(docs, "RayCluster")
    groups = {g["groupName"]: g for g in ray["spec"]["workerGroupSpecs"]}
    assert {name: (g["replicas"], g["maxReplicas"]) for name, g in groups.items()} == {
        "qwen": (1, 3),
        "llama": (1, 1),
    }
    offered = {name: json.loads(json.loads(g["rayStartParams"]["resources"])) for name, g in groups.items()}
    assert offered == {"qwen": {"kvmesh-model-qwen": 1}, "llama": {"kvmesh-model-llama": 1}}
    downloads = {name: g["template"]["spec"]["initContainers"][0]["args"] for name, g in groups.items()}
    assert downloads == {
        "qwen": ["download-model", "kvmesh/tiny-qwen3", "/models/kvmesh--tiny-qwen3"],
        "llama": ["download-model", "kvmesh/tiny-llama", "/models/kvmesh--tiny-llama", "--revision=v1"],
    }
    [router] = [spec for owner, _, spec in pods(docs) if owner.endswith("-router")]
    assert [(c["name"], c["args"][-1]) for c in router["initContainers"]] == [
        ("download-qwen", "--tokenizer-only"),
        ("download-llama", "--tokenizer-only"),
    ]
    configs = controller_configs(docs)
    placed = {
        c.ray_resource: (
            c.model_id,
            c.replicas,
            c.replica.engine.num_kv_blocks,
            c.replica.engine.max_num_seqs,
        )
        for c in configs
    }
    assert placed == {
        "kvmesh-model-qwen": ("kvmesh/tiny-qwen3", 1, 4096, 32),
        "kvmesh-model-llama": ("kvmesh/tiny-llama", 1, 1024, 64),
    }
    assert [c.router.block_size for c in configs] == [16, 32]
    assert configs[1].router.api.served_model_name == "llama"


def test_a_model_on_vllm_runs_the_vllm_image_and_its_replicas_run_vllm(chart):
    """``engine: {kind: vllm}`` on one of two models: that model's worker group (its download
    too: one image a pod) runs the image's vLLM variant, the other model and the router keep
    the plain image, and the controller's replicas of that model parse to engine=vllm with
    its ``vllm serve`` arguments, as ``kvmesh up`` reads them."""
    values = values_of(CHART / "ci" / "multi-model-values.yaml")
    values["models"][1]["engine"] = {"kind": "vllm", "vllmArgs": "--enable-chunked-prefill --swap-space=1"}
    values["image"] = {"repository": "registry.example/kvmesh", "tag": "1.2.3"}
    docs = render(chart, values)
    jsonschema.validate(chart.merge_values(values), SCHEMA)
    images = {
        owner: {c["image"] for c in [*spec.get("initContainers", []), *spec["containers"]]}
        for owner, _, spec in pods(docs)
        if owner.startswith("ray-") or owner.endswith(("-router", "-controller"))
    }
    plain, vllm = {"registry.example/kvmesh:1.2.3"}, {"registry.example/kvmesh:1.2.3-vllm"}
    assert images.pop("ray-llama") == vllm
    assert set(images) == {"ray-head", "ray-qwen", "llm-kvmesh-router", "llm-kvmesh-controller"}
    assert all(i == plain for i in images.values()), images

    configs = controller_configs(docs)
    engines = {c.model_id: (c.replica.engine_kind, c.replica.vllm_args) for c in configs}
    assert engines == {
        "kvmesh/tiny-qwen3": ("kvmesh", ""),
        "kvmesh/tiny-llama": ("vllm", "--enable-chunked-prefill --swap-space=1"),
    }

    values["image"]["vllm"] = {"digest": "sha256:" + "0" * 64}
    [ray] = by_kind(render(chart, values), "RayCluster")
    pinned = {
        g["groupName"]: g["template"]["spec"]["containers"][0]["image"]
        for g in ray["spec"]["workerGroupSpecs"]
    }
    assert pinned == {
        "qwen": "registry.example/kvmesh:1.2.3",
        "llama": "registry.example/kvmesh@sha256:" + "0" * 64,
    }


def test_the_engines_gpu_settings_reach_the_replicas_for_all_models_or_one(chart):
    """Attention backend, CUDA graphs and async scheduling: unset, the engine decides;
    set on controller.engine, every model's replicas get them; set on one model, that one."""

    def engines(values: dict) -> list[tuple]:
        jsonschema.validate(chart.merge_values(values), SCHEMA)
        return [
            (e.attention_backend, e.enforce_eager, e.async_scheduling)
            for e in (c.replica.engine for c in controller_configs(render(chart, values)))
        ]

    assert engines({}) == [(None, False, None)]
    gpu = {"attentionBackend": "triton", "enforceEager": True, "asyncScheduling": "off"}
    assert engines({"controller": {"engine": gpu}}) == [("triton", True, False)]
    values = values_of(CHART / "ci" / "multi-model-values.yaml")
    assert engines(values) == [(None, False, None)] * 2
    values["models"][1]["engine"] = {
        "attentionBackend": "torch",
        "asyncScheduling": "on",
        "enforceEager": True,
    }
    assert engines(values) == [(None, False, None), ("torch", True, True)]


def test_a_models_false_or_zero_wins_over_the_shared_setting(chart):
    """Helm's ``merge`` and ``default`` take false, 0 and "" for unset: a model's own
    ``enforceEager: false``, ``numKvBlocks: 0`` (size the pool from memory), ``maxModelLen: 0``
    (the model's own) or ``minReplicas: 0`` must still replace the shared value."""
    values = values_of(CHART / "ci" / "multi-model-values.yaml")
    values["controller"]["engine"]["enforceEager"] = True
    values["models"][0]["engine"] = {"enforceEager": False, "numKvBlocks": 0, "dtype": ""}
    values["models"][0]["workers"] = {"replicas": 0, "minReplicas": 0, "maxReplicas": 2}
    values["ray"]["workerGroups"][0]["maxReplicas"] = 3
    values["model"]["maxModelLen"] = 512
    values["models"][0]["maxModelLen"] = 0  # the model's own
    jsonschema.validate(chart.merge_values(values), SCHEMA)
    docs = render(chart, values)
    engines = [c.replica.engine for c in controller_configs(docs)]
    assert [(e.enforce_eager, e.num_kv_blocks, e.dtype) for e in engines] == [
        (False, None, None),  # None: the engine sizes its pool from memory
        (True, 1024, "float32"),
    ]
    assert [c.replica.engine.max_model_len for c in controller_configs(docs)] == [None, 512]
    [ray] = by_kind(docs, "RayCluster")
    groups = {g["groupName"]: g for g in ray["spec"]["workerGroupSpecs"]}
    assert [(g["replicas"], g["minReplicas"], g["maxReplicas"]) for g in groups.values()] == [
        (0, 0, 2),
        (1, 1, 1),
    ]


def test_a_host_tier_reaches_the_replicas_for_all_models_or_one_and_null_keeps_the_default(chart):
    def host(values: dict) -> list:
        jsonschema.validate(chart.merge_values(values), SCHEMA)
        return [c.replica.engine.host_kv_gib for c in controller_configs(render(chart, values))]

    assert host({}) == [None]  # the engine's default (on a GPU: a share of the pod's memory)
    assert host({"controller": {"engine": {"hostKvGib": 32}}}) == [32]
    assert host({"controller": {"engine": {"hostKvGib": 0}}}) == [0]
    values = values_of(CHART / "ci" / "multi-model-values.yaml")
    values["controller"]["engine"]["hostKvGib"] = 16
    values["models"][1]["engine"] = {"hostKvGib": 0}  # a model's 0 wins over the shared 16
    assert host(values) == [16, 0]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(chart.merge_values({"controller": {"engine": {"hostKvGib": -1}}}), SCHEMA)
