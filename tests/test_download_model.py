"""``kvmesh download-model`` against a local server in the hub's layout (``fake_hub.py``):
what a chart's init container runs at deploy time. The environment is the image's
(``HF_HUB_OFFLINE=1``): only this command may reach the hub."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHub, Repo, repo_from_folder

from kvmesh.cluster.download import MARKER

pytestmark = pytest.mark.servers
KVMESH = str(Path(sys.executable).with_name("kvmesh"))


@pytest.fixture(scope="module")
def hub(qwen3_dir, llama_dir):
    server = FakeHub()
    files = repo_from_folder(qwen3_dir)
    server.repos["acme/tiny"] = Repo({"main": files, "v2": repo_from_folder(llama_dir)})
    server.repos["acme/private"] = Repo({"main": files}, token="hf_s3cret")
    server.repos["acme/flaky"] = Repo({"main": files}, broken={"model.safetensors"})
    yield server
    server.close()


def download(hub, *args, token=None):
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(Path(args[1]).parent / "hf"),
    }
    env.pop("HF_TOKEN", None)
    if token:
        env["HF_TOKEN"] = token
    return subprocess.run(
        [KVMESH, "download-model", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_a_model_arrives_whole_and_loads_offline(hub, tmp_path):
    dest = tmp_path / "models" / "tiny"
    out = download(hub, "acme/tiny", str(dest))
    assert out.returncode == 0, out.stderr
    names = {p.name for p in dest.iterdir()}
    assert {"config.json", "tokenizer.json", "model.safetensors", MARKER} <= names
    check = (
        "from kvmesh.replica import LLMEngine, SamplingParams\n"
        f"e = LLMEngine({str(dest)!r}, num_kv_blocks=16)\n"
        "print(len(e.generate('hello', SamplingParams(temperature=0, max_tokens=3))[0].token_ids))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", check],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert loaded.stdout.strip() == "3", loaded.stderr
    before = len(hub.requests)
    again = download(hub, "acme/tiny", str(dest))  # an init container that runs again
    assert again.returncode == 0 and len(hub.requests) == before  # kept as it is: no request at all


def test_a_revision_and_the_tokenizer_only_router_copy(hub, tmp_path, llama_dir):
    v2 = download(hub, "acme/tiny", str(tmp_path / "v2"), "--revision", "v2")
    assert v2.returncode == 0, v2.stderr
    assert (tmp_path / "v2" / "config.json").read_bytes() == (llama_dir / "config.json").read_bytes()
    commit = hub.repos["acme/tiny"].commit("v2")
    pinned = download(hub, "acme/tiny", str(tmp_path / "pinned"), "--revision", commit)
    assert (
        pinned.returncode == 0
        and (tmp_path / "pinned" / "config.json").read_bytes() == (llama_dir / "config.json").read_bytes()
    )
    router = download(hub, "acme/tiny", str(tmp_path / "router"), "--tokenizer-only")
    assert router.returncode == 0, router.stderr
    names = {p.name for p in (tmp_path / "router").iterdir()}
    assert (
        "tokenizer.json" in names
        and "config.json" in names
        and not any(n.endswith(".safetensors") for n in names)
    )
    missing = download(hub, "acme/tiny", str(tmp_path / "nope"), "--revision", "v9")
    assert (
        missing.returncode == 2
        and "downloading acme/tiny (v9) failed" in missing.stderr.strip().splitlines()[-1]
    )


def test_a_private_repo_needs_its_token(hub, tmp_path):
    refused = download(hub, "acme/private", str(tmp_path / "p"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert not (tmp_path / "p").exists()
    allowed = download(hub, "acme/private", str(tmp_path / "p"), token="hf_s3cret")
    assert allowed.returncode == 0 and (tmp_path / "p" / "model.safetensors").is_file()


def test_a_failed_download_leaves_nothing_an_engine_could_load(hub, tmp_path):
    out = download(hub, "acme/flaky", str(tmp_path / "flaky"))
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and last.startswith("kvmesh: error: downloading acme/flaky (main) failed"), (
        out.stderr
    )
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("hf")] == []  # no folder, no partial


def test_a_folder_it_did_not_fill_is_left_alone(hub, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "weights.bin").write_text("someone else's")
    out = download(hub, "acme/tiny", str(tmp_path / "mine"))
    assert out.returncode == 2 and "did not download" in out.stderr
    assert (tmp_path / "mine" / "weights.bin").read_text() == "someone else's"
