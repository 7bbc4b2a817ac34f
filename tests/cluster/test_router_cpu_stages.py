"""The router CPU benchmark's stage attribution follows the code: every marker naming a kvmesh
module names one that exists (a rename once left half the request path in "other")."""

from pathlib import Path

import pytest

from kvmesh.bench.router_cpu import STAGES, stage_of

PACKAGE = Path(__file__).resolve().parents[2]  # the repository root is the package
LAYERS = ("kvcache/", "serving/", "router/", "replica/", "cluster/")


def test_every_kvmesh_marker_names_a_module_or_folder_of_the_package():
    markers = [m for _, ms in STAGES for m in ms if m.startswith(LAYERS)]
    assert len(markers) > 20
    missing = [
        m for m in markers if not (PACKAGE / f"{m}.py").is_file() and not (PACKAGE / m.rstrip("/")).is_dir()
    ]
    assert missing == []


@pytest.mark.parametrize(
    ("module", "stage"),
    [
        ("serving/openai/protocol.py:model_validate_json", "parse"),
        ("serving/openai/responses.py:chunk", "response encoding"),
        ("serving/openai/relay.py:take_trailer", "relay"),
        ("router/shared_load.py:add", "policy"),
        ("router/index_trust/watch.py:observe", "policy"),
        ("kvcache/hashing.py:block_hashes", "hash"),
        ("kvcache/index/redis.py:routing_view", "index calls"),
    ],
)
def test_request_path_modules_fall_in_their_stage(module, stage):
    assert stage_of(f"{PACKAGE}/{module}") == stage
