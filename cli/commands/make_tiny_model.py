"""``kvmesh make-tiny-model DIR``: a small random model + tokenizer folder, built offline."""

from __future__ import annotations

import argparse
from pathlib import Path

SIZES = ("hidden", "layers", "heads", "kv_heads", "vocab_size", "max_position_embeddings")


def register(commands) -> None:
    tiny = commands.add_parser(
        "make-tiny-model", help="write a small random model + tokenizer folder (offline)"
    )
    tiny.add_argument("dir", help="output folder (must not exist or be empty, unless --force)")
    tiny.add_argument("--force", action="store_true", help="replace DIR if it already holds something")
    tiny.add_argument("--arch", choices=["qwen3", "qwen2", "llama"], default="qwen3")
    tiny.add_argument("--hidden", type=int, default=64, help="hidden size")
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--heads", type=int, default=4)
    tiny.add_argument("--kv-heads", type=int, default=2)
    tiny.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size to train")
    tiny.add_argument("--max-position-embeddings", type=int, default=4096)
    tiny.add_argument("--tie-embeddings", action="store_true", help="share embedding and lm_head weights")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.cluster.errors import UsageError
    from kvmesh.engine.models.tiny_model import make_tiny_model

    for name in SIZES:
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    target = Path(args.dir)
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not args.force:
        raise UsageError(f"{args.dir} already exists and is not empty; --force replaces it")
    sizes = {name: getattr(args, name) for name in SIZES}
    try:
        path = make_tiny_model(
            args.dir, arch=args.arch, tie_word_embeddings=args.tie_embeddings, seed=args.seed, **sizes
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(f"wrote {path}")
    return 0
