"""``kvmesh download-model``: a Hugging Face hub repo into a local folder, at deploy time.

The only place kvmesh touches a model hub: the chart's init containers run it, then the
engine and the router read the folder with ``HF_HUB_OFFLINE=1``. Only what serving reads
is fetched (config, tokenizer and chat template; plus safetensors weights unless
``--tokenizer-only``). Files land in a temporary folder next to the destination, which is
renamed into place only when the download is complete: a failed or interrupted download
never leaves a half-written model where an engine would load it. A folder this command
completed before, for the same repo and revision, is kept as it is (init containers rerun
on every pod start).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

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
    done = completed(dest)
    if done is not None and {k: done.get(k) for k in wanted} == wanted:
        return dest
    if dest.exists() and any(p.name != "lost+found" for p in dest.iterdir()) and done is None:
        raise DownloadError(f"{dest} holds files this command did not download; give an empty folder")
    os.environ["HF_HUB_OFFLINE"] = "0"  # deploy time: this command is the one that may download
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    patterns = CONFIG_FILES + ([] if tokenizer_only else WEIGHT_FILES)
    try:
        snapshot_download(
            repo_id,
            revision=revision,
            local_dir=partial,
            allow_patterns=patterns,
            token=os.environ.get("HF_TOKEN"),
        )
        _check(partial, tokenizer_only)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise DownloadError(
            f"downloading {repo_id} ({wanted['revision']}) failed: {_first_line(exc)}"
        ) from None
    shutil.rmtree(partial / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping
    (partial / MARKER).write_text(json.dumps(wanted))
    if dest.exists():
        shutil.rmtree(dest)  # an older completed download (another repo or revision)
    os.replace(partial, dest)
    return dest


def _check(folder: Path, tokenizer_only: bool) -> None:
    if not (folder / "config.json").is_file():
        raise ValueError("the repo has no config.json: not a model")
    if not tokenizer_only and not any(folder.glob("*.safetensors")):
        raise ValueError("the repo has no safetensors weights (kvmesh does not load .bin checkpoints)")


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
