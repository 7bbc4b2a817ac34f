"""``kvmesh download-model``: a Hugging Face hub repo into a local folder, at deploy time.

The only place kvmesh touches a model hub: the chart's init containers run it, then the
engine and the router read the folder with ``HF_HUB_OFFLINE=1``. Only what serving reads
is fetched (config, tokenizer and chat template; plus safetensors weights unless
``--tokenizer-only``). Files land in a temporary folder of this process's own next to the
destination, which is renamed into place only when the download is complete: a failed or
interrupted download never leaves a half-written model where an engine would load it. A
folder this command completed before, for the same repo and revision, is kept as it is
(init containers rerun on every pod start).

Several pods may download into one shared folder at once: one downloads (a lock beside the
folder), the others wait and then reuse what it completed; and a completed folder is
swapped for another revision only while no server is loading it (``serving.model_lock``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from kvmesh.serving.model_lock import lock_file, locked

CONFIG_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
]
WEIGHT_FILES = ["*.safetensors", "model.safetensors.index.json"]
MARKER = ".kvmesh-download.json"  # what a completed download holds, written last


class DownloadError(RuntimeError):
    """A download that did not complete; the message is the one line a user needs."""


def completed(dest: Path) -> dict | None:
    """The record of a completed download into ``dest``, if there is one."""
    marker = dest / MARKER
    return json.loads(marker.read_text()) if marker.is_file() else None


def download_model(
    repo_id: str, dest: str | Path, revision: str | None = None, tokenizer_only: bool = False
) -> Path:
    """Download ``repo_id`` at ``revision`` (default: main) into ``dest``; returns ``dest``.

    The token, where the repo needs one, comes from ``HF_TOKEN``; ``HF_ENDPOINT`` selects
    another hub (a mirror, or the test's local server).
    """
    dest = Path(dest)
    wanted = {"repo": repo_id, "revision": revision or "main", "tokenizer_only": tokenizer_only}
    if _holds(dest, wanted):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with locked(lock_file(dest, "download"), exclusive=True):  # one download into dest at a time
        if _holds(dest, wanted):  # another process completed it while this one waited
            return dest
        if dest.exists() and any(p.name != "lost+found" for p in dest.iterdir()) and completed(dest) is None:
            raise DownloadError(f"{dest} holds files this command did not download; give an empty folder")
        partial = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
        try:
            _fetch(repo_id, revision, partial, tokenizer_only)
        except DownloadError:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        (partial / MARKER).write_text(json.dumps(wanted))
        with locked(lock_file(dest), exclusive=True):  # no server is loading dest now
            _swap_in(partial, dest)
    return dest


def _holds(dest: Path, wanted: dict) -> bool:
    done = completed(dest)
    return done is not None and {k: done.get(k) for k in wanted} == wanted


def _fetch(repo_id: str, revision: str | None, into: Path, tokenizer_only: bool) -> None:
    os.environ["HF_HUB_OFFLINE"] = "0"  # deploy time: this command is the one that may download
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = CONFIG_FILES + ([] if tokenizer_only else WEIGHT_FILES)
    try:
        snapshot_download(
            repo_id,
            revision=revision,
            local_dir=into,
            allow_patterns=patterns,
            token=os.environ.get("HF_TOKEN"),
        )
        _check(into, tokenizer_only)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise DownloadError(
            f"downloading {repo_id} ({revision or 'main'}) failed: {_first_line(exc)}"
        ) from None
    shutil.rmtree(into / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping


def _swap_in(partial: Path, dest: Path) -> None:
    """``partial`` becomes ``dest`` (two renames, under the folder's exclusive lock: no
    server is loading it meanwhile); an older completed download there is removed after."""
    old = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.replace(dest, old / dest.name)
    os.replace(partial, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _check(folder: Path, tokenizer_only: bool) -> None:
    if not (folder / "config.json").is_file():
        raise ValueError("the repo has no config.json: not a model")
    if not tokenizer_only and not any(folder.glob("*.safetensors")):
        raise ValueError("the repo has no safetensors weights (kvmesh does not load .bin checkpoints)")


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
