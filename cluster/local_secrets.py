"""The secrets one ``kvmesh up`` makes for itself where the user gave none: random values in
files only this user can read, in a private folder removed when it stops. Processes get the
paths, never the values (nothing in flags, the environment or ``ps``)."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path


class LocalSecrets:
    def __init__(self):
        self._folder: Path | None = None

    @property
    def folder(self) -> Path | None:
        return self._folder

    def write(self, name: str, value: str) -> str:
        """Store ``value`` as ``name`` (mode 0600); returns its path."""
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="kvmesh-secrets-"))  # mode 0700
        path = self._folder / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value)
        return str(path)

    def new(self, name: str) -> tuple[str, str]:
        """A fresh random secret stored as ``name``: (its path, its value)."""
        value = secrets.token_urlsafe(32)
        return self.write(name, value), value

    def close(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
