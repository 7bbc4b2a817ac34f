"""``kvmesh download-model REPO DIR``: fetch a hub model into a folder (deploy time only)."""

from __future__ import annotations

import argparse


def register(commands) -> None:
    dl = commands.add_parser(
        "download-model",
        help="fetch a Hugging Face hub model into a folder (deploy time; HF_TOKEN, HF_ENDPOINT)",
    )
    dl.add_argument("repo", help="hub repo id, e.g. Qwen/Qwen3-0.6B")
    dl.add_argument(
        "dir", help="the model folder to create (kept if it already holds this repo and revision)"
    )
    dl.add_argument("--revision", help="branch, tag or commit (default: main)")
    dl.add_argument(
        "--tokenizer-only", action="store_true", help="config and tokenizer files only (the router)"
    )
    dl.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.cli.download import DownloadError, download_model
    from kvmesh.cluster.errors import UsageError

    try:
        path = download_model(args.repo, args.dir, args.revision, args.tokenizer_only)
    except DownloadError as exc:
        raise UsageError(str(exc)) from None
    print(f"{args.repo} ({args.revision or 'main'}) is in {path}")
    return 0
