"""One metrics endpoint per pod, however many replicas share it.

On Kubernetes a Ray worker pod may host several replica processes, each with its own
metrics on a port nobody can predict, so a PodMonitor cannot find them. Every replica
writes its metrics to a per-port folder on the node every ``interval_s``; the one that
holds the fixed port (the first to bind it) serves them all on ``/metrics``, each sample
labelled ``replica_id``. When that replica stops, another binds the port at its next turn.
A file not refreshed for ``stale_s`` belongs to a replica that died: it is left out and removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.serving.background import BackgroundLoops, sleep_to_next_tick
from kvmesh.serving.open_endpoint import METRICS_TYPE, start_open_endpoint

log = logging.getLogger(__name__)


def pod_metrics_dir(port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"kvmesh-pod-metrics-{port}"


def merge_metrics(pages: dict[str, str]) -> bytes:
    """Several replicas' metrics pages as one, each sample labelled with its replica's id."""
    families: dict[str, object] = {}
    for replica_id, text in sorted(pages.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, family)
            labelled = [s._replace(labels={**s.labels, "replica_id": replica_id}) for s in family.samples]
            if merged is family:
                family.samples = labelled
            else:
                merged.samples.extend(labelled)

    class _Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)


class PodMetrics:
    def __init__(
        self,
        replica_id: str,
        render: Callable[[], bytes],
        host: str,
        port: int,
        interval_s: float = 2.0,
        stale_s: float = 10.0,
    ):
        self.replica_id = replica_id
        self.render = render
        self.host, self.port = host, port
        self.interval_s, self.stale_s = interval_s, stale_s
        self.folder = pod_metrics_dir(port)
        self.server: asyncio.Server | None = None
        self._loops = BackgroundLoops()

    @property
    def serving(self) -> bool:
        return self.server is not None

    async def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        await self._turn()
        self._loops.start(self._loop, "kvmesh-pod-metrics")

    async def stop(self) -> None:
        await self._loops.stop()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None
        with contextlib.suppress(FileNotFoundError):
            (self.folder / f"{self.replica_id}.prom").unlink()

    async def _loop(self) -> None:
        while self._loops.running:
            await sleep_to_next_tick(self.interval_s)
            await self._turn()

    async def _turn(self) -> None:
        """Publish this replica's page; take the port if nobody holds it."""
        mine = self.folder / f"{self.replica_id}.prom"
        partial = mine.with_suffix(f".{os.getpid()}.tmp")
        partial.write_bytes(self.render())
        partial.replace(mine)  # atomic: the exporter never reads half a page
        if self.server is None:
            try:
                self.server = await start_open_endpoint(self.host, self.port, {"/metrics": self._metrics})
            except OSError:
                return  # another replica on this pod exports
            log.info(
                "serving this pod's replica metrics", extra={"port": self.port, "replica_id": self.replica_id}
            )

    def page(self) -> bytes:
        pages, now = {}, time.time()
        for path in self.folder.glob("*.prom"):
            with contextlib.suppress(FileNotFoundError):
                if now - path.stat().st_mtime > self.stale_s:
                    path.unlink()  # its replica died without removing it
                    continue
                pages[path.stem] = path.read_text()
        pages[self.replica_id] = self.render().decode()  # its own, fresh
        return merge_metrics(pages)

    async def _metrics(self) -> tuple[int, str, bytes]:
        return 200, METRICS_TYPE, await asyncio.to_thread(self.page)
