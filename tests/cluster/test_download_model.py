"""``kvmesh download-model`` against a local server in the hub's layout (``fake_hub.py``):
what a chart's init container runs at deploy time. The environment is the image's
(``HF_HUB_OFFLINE=1``): only this command may reach the hub. Several init containers on one
shared volume may run it at once: one downloads, the others wait and reuse, and a model a
server is loading is never swapped under it."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_hub import FakeHub, Repo, repo_from_folder

from kvmesh.cli.download import MARKER
from kvmesh.serving.model_lock import reading_model

pytestmark = pytest.mark.servers
KVMESH = str(Path(sys.executable).with_name("kvmesh"))


@pytest.fixture(scope="module")
def hub(qwen3_dir, llama_dir):
    server = FakeHub()
    files = repo_from_folder(qwen3_dir)
    server.repos["acme/tiny"] = Repo({"main": files, "v2": repo_from_folder(llama_dir)})
    server.repos["acme/private"] = Repo({"main": files}, token="hf_s3cret")
    # the weights refused half way through the download (403: not retried, so it fails at once)
    server.repos["acme/flaky"] = Repo({"main": files}, broken={"model.safetensors"}, broken_status=403)
    yield server
    server.close()


def download(hub, *args, token=None, wait=True):
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(Path(args[1]).parent / "hf"),
    }
    env.pop("HF_TOKEN", None)
    if token:
        env["HF_TOKEN"] = token
    argv = [KVMESH, "download-model", *args]
    if not wait:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)


def test_a_model_arrives_whole_and_loads_offline(hub, tmp_path):
    dest = tmp_path / "models" / "tiny"
    out = download(hub, "acme/tiny", str(dest))
    assert out.returncode == 0, out.stderr
    names = {p.name for p in dest.iterdir()}
    assert {"config.json", "tokenizer.json", "model.safetensors", MARKER} <= names
    check = (
        "from kvmesh.engine import LLMEngine, SamplingParams\n"
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
    left = [
        p.name for p in tmp_path.iterdir() if not p.name.startswith("hf") and not p.name.endswith(".lock")
    ]
    assert left == []  # no folder, no partial (the lock files stay: tiny, and shared by later runs)


def test_a_folder_it_did_not_fill_is_left_alone(hub, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "weights.bin").write_text("someone else's")
    out = download(hub, "acme/tiny", str(tmp_path / "mine"))
    assert out.returncode == 2 and "did not download" in out.stderr
    assert (tmp_path / "mine" / "weights.bin").read_text() == "someone else's"


def test_three_downloads_into_one_folder_at_once_fetch_once_and_all_succeed(hub, tmp_path):
    """Init containers of three pods on one ReadWriteMany volume (each with pid 1: a temporary
    folder named by pid alone was shared by all of them, and the later finishers removed a
    complete model an engine may have been loading)."""
    dest = tmp_path / "models" / "tiny"
    hub.delay_s = 1.0  # every file takes a while: the three are in flight together

    def weights_fetched() -> int:
        return sum(r.startswith("GET ") and r.endswith("/model.safetensors") for r in hub.requests)

    before = weights_fetched()
    try:
        procs = [download(hub, "acme/tiny", str(dest), wait=False) for _ in range(3)]
        seen_whole, vanished = False, False
        while any(p.poll() is None for p in procs):
            whole = (dest / MARKER).is_file()
            vanished |= seen_whole and not whole  # a complete model must never go away
            seen_whole |= whole
            time.sleep(0.01)
    finally:
        hub.delay_s = 0.0
    outs = [p.communicate() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outs]
    assert weights_fetched() - before == 1  # one downloaded, two waited and reused it
    assert seen_whole and not vanished
    left = sorted(p.name for p in dest.parent.iterdir() if p.name != "hf" and not p.name.endswith(".lock"))
    assert left == ["tiny"]  # no partial folder left behind


def test_a_new_revision_waits_for_a_server_loading_the_folder(hub, tmp_path, qwen3_dir, llama_dir):
    dest = tmp_path / "models" / "tiny"
    assert download(hub, "acme/tiny", str(dest)).returncode == 0
    with reading_model(dest):  # a server loading the model
        proc = download(hub, "acme/tiny", str(dest), "--revision", "v2", wait=False)
        v2_weights = f"GET /acme/tiny/resolve/{hub.repos['acme/tiny'].commit('v2')}/model.safetensors"
        deadline = time.monotonic() + 60
        while v2_weights not in hub.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # its files are in: it would swap now if it could
        assert proc.poll() is None  # it waits for the reader
        assert (dest / "config.json").read_bytes() == (qwen3_dir / "config.json").read_bytes()
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    assert (dest / "config.json").read_bytes() == (llama_dir / "config.json").read_bytes()


def test_a_volume_that_cannot_lock_runs_unlocked(tmp_path, monkeypatch, caplog):
    from kvmesh.serving import model_lock

    def no_locks(fd, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(model_lock.fcntl, "flock", no_locks)
    folder = tmp_path / "tiny"
    with model_lock.locked(model_lock.lock_file(folder, "download"), exclusive=True):
        ran = True
    assert ran and "cannot lock the model folder" in caplog.text
