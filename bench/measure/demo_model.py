"""The small random Qwen3 that the demo, the benchmarks and the experiment suite run, built
once in a cache folder."""

from __future__ import annotations

from pathlib import Path


def demo_model(cache_dir: Path) -> Path:
    from kvmesh.engine.models.tiny_model import cached_tiny_model

    path = Path(cache_dir) / "demo-qwen3-h256-l4"
    if not (path / "config.json").is_file():
        print(f"building the tiny model in {path} (once)")
    return cached_tiny_model(path, hidden=256, layers=4, heads=4, kv_heads=2)
