"""Model folders shared by several pods (a ReadWriteMany volume): a downloader never swaps a
folder while a server is reading it. Readers take a shared lock on ``.<name>.lock`` beside
the folder while they load it; ``kvmesh download-model`` takes it exclusively for the swap.
A folder that no download ever touched has no lock file, and reading it waits for nothing."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


def lock_file(folder: str | Path, purpose: str = "") -> Path:
    folder = Path(folder)
    return folder.parent / f".{folder.name}{'.' + purpose if purpose else ''}.lock"


@contextlib.contextmanager
def locked(path: Path, exclusive: bool) -> Iterator[None]:
    """Hold ``path`` (an flock: NFS clients carry it across machines) until the block ends;
    a shared hold on a lock file that does not exist holds nothing, and on a file system
    that cannot lock, the block runs unlocked (as it did before there were locks), said once."""
    if not exclusive and not path.exists():
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT if exclusive else os.O_RDONLY, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        except OSError as exc:  # ENOLCK, EOPNOTSUPP: a volume without locks
            log.warning(
                "cannot lock the model folder; going on without",
                extra={"lock": str(path), "error": exc.strerror},
            )
        yield
    finally:
        os.close(fd)


def reading_model(folder: str | Path) -> contextlib.AbstractContextManager[None]:
    """While a server loads ``folder``: no download swaps it meanwhile."""
    return locked(lock_file(folder), exclusive=False)
