"""Shared fixtures: tiny random models built once per machine and cached on disk."""

import os
from pathlib import Path

import pytest

CACHE = Path(
    os.environ.get("KVMESH_TEST_CACHE", Path(__file__).resolve().parent.parent / ".cache" / "tiny-models")
)


def tiny_model_dir(arch: str = "qwen3", **kwargs) -> Path:
    """Build (once) and return a tiny model folder; the name encodes every setting."""
    from kvmesh.replica.tiny_model import make_tiny_model

    name = "-".join([arch] + [f"{k}{v}" for k, v in sorted(kwargs.items())]) or arch
    path = CACHE / name
    if not (path / "config.json").is_file():
        make_tiny_model(path, arch=arch, **kwargs)
    return path


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def qwen2_dir() -> Path:
    return tiny_model_dir("qwen2")
