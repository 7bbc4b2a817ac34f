"""What a reader of the shared index does with an entry it cannot trust: skip it, count it,
and say so once.

Every process of a deployment writes into one server, and a role's functions can only write
what the role may write raw (Redis checks a function's commands against its caller's ACL
user), so any router or replica can put any bytes in a record, a load entry or the settings.
A reader takes each entry on its own: a bad one costs only itself.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

log = logging.getLogger(__name__)

_LOGGED_MAX = 1024  # entries named in the log at most once each; past this, only counted


class UntrustedEntries:
    """Counts of the index entries skipped, by kind ("record", "load", "settings"), with a
    warning the first time each entry is skipped."""

    def __init__(self) -> None:
        self.skipped: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()
        self.on_skip: Callable[[str], None] | None = None  # e.g. a metric's increment

    def reject(self, kind: str, key: str, why: Exception) -> None:
        self.skipped[kind] += 1
        if self.on_skip is not None:
            self.on_skip(kind)
        entry = (kind, key[:64])
        if entry not in self._logged and len(self._logged) < _LOGGED_MAX:
            self._logged.add(entry)
            log.warning(
                "skipped a malformed index entry",
                extra={"kind": kind, "entry": ascii(entry[1]), "error": str(why)[:200]},
            )
