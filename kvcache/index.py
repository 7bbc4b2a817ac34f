"""Client of the shared prefix index (Redis/Valkey), used by replicas and the router.

Every call is one round trip to a server-side function (``index.lua`` beside this file, loaded with
``FUNCTION LOAD``). Replicas ``register`` (a new incarnation each time), ``heartbeat``
with their load, ``publish`` their KV events in order and ``deregister``; the router
``lookup``s a prompt's block hashes and lists ``live_replicas``. The key layout and its
memory cost are documented in ``index.lua`` and the README.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TypeVar
from urllib.parse import urlsplit

import numpy as np
import redis.asyncio as aioredis
import xxhash
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from kvmesh.kvcache import BlockRemoved, BlockStored, KVEvent

_LIBRARY = resources.files("kvmesh.kvcache").joinpath("index.lua").read_text()
_PUBLISH_CHUNK = 20_000  # hashes per publish call when resyncing a whole cache


T = TypeVar("T")
# What a call to the index raises when Redis is away, slow or refuses: callers degrade on these.
INDEX_ERRORS = (RedisError, OSError, asyncio.TimeoutError)


class IndexSettingsError(RuntimeError):
    """This process's model id / block size / hash seed differ from the cluster's."""


@dataclass(frozen=True)
class ReplicaRecord:
    replica_id: str
    address: str
    incarnation: int
    heartbeat_ttl_ms: int  # time left before the replica stops counting as live
    fields: Mapping[str, str]  # everything else in its record (load, start time, ...)

    def load(self, name: str, default: float = 0.0) -> float:
        value = self.fields.get(name)
        return float(value) if value not in (None, "") else default


@dataclass(frozen=True)
class FleetWork:
    """What every live router has in flight on one replica (``kvmesh_reserve``)."""

    requests: float = 0.0
    prefill_blocks: float = 0.0
    decode_blocks: float = 0.0


LOAD_FIELDS = {"n": "requests", "p": "prefill_blocks", "d": "decode_blocks"}


@dataclass(frozen=True)
class IndexView:
    """What one ``decide`` call returns (blocks per replica, work per replica)."""

    matched: dict[str, int]  # leading blocks each replica published
    speculative: dict[str, int]  # leading blocks routers just sent it (not published yet)
    fleet: dict[str, FleetWork] | None  # None: not asked (this router does not share its load)


def load_field(replica_id: str, kind: str) -> str:
    return f"{replica_id}|{kind}"


def pack_hashes(hashes: Iterable[int]) -> bytes:
    """Block hashes as the index's 8-byte big-endian keys."""
    return np.fromiter(hashes, dtype=">u8").tobytes()


def namespace(model_id: str) -> str:
    """The hash-tagged key prefix of one model's index (short: it is in every block key)."""
    return f"{{k:{xxhash.xxh32_intdigest(model_id.encode()):08x}}}"


def connect(
    url: str,
    timeout: float = 2.0,
    *,
    username: str | None = None,
    password: str | None = None,
    ca_file: str | None = None,
) -> aioredis.Redis:
    """A client that fails fast: callers decide how to degrade when Redis is away.

    ``redis://``, ``rediss://`` (TLS, verified against ``ca_file`` when given) or ``unix://``.
    ``password`` (and ACL ``username``) apply when the URL carries none, so secrets can stay
    out of URLs, flags and logs.
    """
    extra = {}
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"not a Redis URL (redis://, rediss:// or unix://): {parts.scheme}://...")
    if not parts.password and password:
        extra["password"] = password
        if username:
            extra["username"] = username
    if parts.scheme == "rediss" and ca_file:
        extra["ssl_ca_certs"] = ca_file
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=10,
        **extra,
    )


class PrefixIndex:
    def __init__(self, client: aioredis.Redis, model_id: str, block_size: int | None, hash_seed: int | None):
        """``block_size``/``hash_seed`` None: a client that never stores the settings (it may
        read them: a router whose block size is "auto", a supervisor, a status tool)."""
        self.client = client
        self.model_id = model_id
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.ns = namespace(model_id)
        self._block_prefix = f"{self.ns}b".encode()
        self._load_key = f"{self.ns}load".encode()
        self._loaded = False

    @classmethod
    def from_url(
        cls, url: str, model_id: str, block_size: int | None, hash_seed: int | None, **credentials: str | None
    ) -> PrefixIndex:
        """``credentials``: ``username``, ``password``, ``ca_file`` (see ``connect``)."""
        return cls(connect(url, **credentials), model_id, block_size, hash_seed)

    async def close(self) -> None:
        await self.client.aclose()

    async def _call(self, function: str, *args, keys: Sequence[bytes] = (), read_only: bool = False):
        """FCALL (ARGV: ns, *args). ``keys``: the keys it reads, when the caller knows them."""
        fcall = self.client.fcall_ro if read_only else self.client.fcall
        return await self._with_library(lambda: fcall(function, len(keys), *keys, self.ns, *args))

    async def _with_library(self, send: Callable[[], Awaitable[T]]) -> T:
        """``send()``, loading the library first if this client has not, and again if the
        server lost it (new or restarted)."""
        if not self._loaded:
            await self.client.function_load(_LIBRARY, replace=True)
            self._loaded = True
        try:
            return await send()
        except ResponseError as exc:
            if "function" not in str(exc).lower() or "not found" not in str(exc).lower():
                raise
            await self.client.function_load(_LIBRARY, replace=True)
            return await send()

    # ------------------------------------------------------------------ settings

    async def ensure_settings(self) -> None:
        """Store the cluster settings once; refuse to run with different ones."""
        if self.block_size is None or self.hash_seed is None:
            raise ValueError("this index client has no settings to store (block size 'auto')")
        mine = {
            "model_id": self.model_id,
            "block_size": str(self.block_size),
            "hash_seed": str(self.hash_seed),
        }
        stored = _pairs(await self._call("kvmesh_settings", *[x for kv in mine.items() for x in kv]))
        wrong = {k: (stored.get(k), v) for k, v in mine.items() if stored.get(k) != v}
        if wrong:
            detail = ", ".join(
                f"{k}: cluster has {have!r}, this process has {want!r}" for k, (have, want) in wrong.items()
            )
            raise IndexSettingsError(f"prefix index settings differ ({detail})")

    async def settings(self) -> dict[str, str] | None:
        """The settings the first replica (or router) stored, None while there are none."""
        stored = await self.client.hgetall(f"{self.ns}settings")
        return {k.decode(): v.decode() for k, v in stored.items()} or None

    async def has_settings(self) -> bool:
        """False when the server lost this model's data (restarted without persistence)."""
        return bool(await self._call("kvmesh_has_settings", read_only=True))

    # ------------------------------------------------------------------ replicas

    async def register(
        self, replica_id: str, address: str, ttl_s: float, info: Mapping[str, object] = ()
    ) -> int:
        """Start a new incarnation (retiring the previous one); returns its number."""
        fields = {"address": address, "started_at": time.time(), "heartbeat_at": time.time(), **dict(info)}
        flat = [str(x) for kv in fields.items() for x in kv]
        return int(await self._call("kvmesh_register", replica_id, int(ttl_s * 1000), *flat))

    async def heartbeat(
        self, replica_id: str, incarnation: int, ttl_s: float, load: Mapping[str, object] = ()
    ) -> bool:
        """Extend liveness and store load; False means the incarnation was retired or expired."""
        flat = [str(x) for kv in {"heartbeat_at": time.time(), **dict(load)}.items() for x in kv]
        return bool(await self._call("kvmesh_heartbeat", replica_id, incarnation, int(ttl_s * 1000), *flat))

    async def deregister(self, replica_id: str, incarnation: int) -> bool:
        return bool(await self._call("kvmesh_deregister", replica_id, incarnation))

    async def retire(self, replica_id: str) -> bool:
        """End a replica's current incarnation now (a supervisor saw its process die)."""
        return bool(await self._call("kvmesh_retire", replica_id))

    async def live_replicas(self) -> list[ReplicaRecord]:
        raw = await self._call("kvmesh_live_replicas")
        records = []
        for flat, ttl in zip(raw[::2], raw[1::2], strict=True):
            fields = _pairs(flat)
            records.append(
                ReplicaRecord(
                    replica_id=fields.pop("replica_id"),
                    address=fields.pop("address"),
                    incarnation=int(fields.pop("incarnation")),
                    heartbeat_ttl_ms=int(ttl),
                    fields=fields,
                )
            )
        return records

    # ------------------------------------------------------------------ blocks

    async def publish(self, replica_id: str, incarnation: int, events: Iterable[KVEvent]) -> bool:
        """Apply Stored/Removed events in order, in one call; False: resync under a new incarnation.

        ``AllBlocksCleared`` is not handled here: the publisher starts a new incarnation.
        """
        args: list = []
        for event in events:
            if isinstance(event, BlockStored):
                op = "+"
            elif isinstance(event, BlockRemoved):
                op = "-"
            else:
                raise TypeError(f"publish takes BlockStored/BlockRemoved, got {event!r}")
            if args and args[-2] == op:
                args[-1] += pack_hashes(event.hashes)
            else:
                args += [op, pack_hashes(event.hashes)]
        if not args:
            return True
        return await self._call("kvmesh_publish", replica_id, incarnation, *args) != 0

    async def publish_all(self, replica_id: str, incarnation: int, hashes: Iterable[int]) -> bool:
        """Publish a whole cache (resync), in chunks so no single call blocks Redis for long."""
        hashes = list(hashes)
        for start in range(0, len(hashes), _PUBLISH_CHUNK):
            packed = pack_hashes(hashes[start : start + _PUBLISH_CHUNK])
            if await self._call("kvmesh_publish", replica_id, incarnation, "+", packed) == 0:
                return False
        return True

    def _block_keys(self, block_hashes: Iterable[int]) -> list[bytes]:
        # Built here, not in the server's Lua (which took ~0.15 us a key): the server is
        # shared by every router, the clients scale out.
        packed, prefix = pack_hashes(block_hashes), self._block_prefix
        return [prefix + packed[i : i + 8] for i in range(0, len(packed), 8)]

    async def lookup(self, block_hashes: Iterable[int]) -> dict[str, int]:
        """Matched leading blocks per live replica holding at least the first block (what the
        replicas published; routers' speculative entries are left out)."""
        keys = self._block_keys(block_hashes)
        if not keys:
            return {}
        return _matches(await self._call("kvmesh_lookup", keys=keys, read_only=True))[0]

    async def decide(self, block_hashes: Iterable[int]) -> IndexView:
        """Everything a routing decision reads, in one round trip: the replicas' matches, the
        routers' speculative matches and every router's in-flight work per replica. The
        work is a plain HGETALL pipelined behind the lookup: through Lua, its reply cost the
        server ~40 us more per decision at 64 replicas."""
        keys = self._block_keys(block_hashes)

        def send() -> Awaitable[list]:
            pipe = self.client.pipeline(transaction=False)
            if keys:
                pipe.fcall_ro("kvmesh_lookup", len(keys), *keys, self.ns)
            pipe.hgetall(self._load_key)
            return pipe.execute()

        replies = await self._with_library(send)
        flat, load = (replies[0], replies[1]) if keys else ([], replies[0])
        work: dict[str, dict[str, float]] = {}
        for field, value in load.items():
            replica_id, _, kind = field.decode().rpartition("|")
            if kind in LOAD_FIELDS:
                work.setdefault(replica_id, {})[LOAD_FIELDS[kind]] = max(0.0, float(value))
        matched, speculative = _matches(flat)
        return IndexView(matched, speculative, {rid: FleetWork(**w) for rid, w in work.items()})

    async def speculate(
        self,
        router_incarnation: int,
        entries: Mapping[str, Sequence[int]],
        ttl_s: float,
        bucket: int | None = None,
    ) -> bool:
        """Record that this router sent each replica a prompt with these blocks (a whole chain:
        a speculative match, like a replica's, runs from the first block); every router's
        ``decide`` sees them for ``ttl_s`` to twice that. ``bucket``: ``speculation_bucket``
        (now, by default). False: the router expired."""
        return await self.share(router_incarnation, {}, entries, ttl_s, bucket)

    async def share(
        self,
        router_incarnation: int,
        deltas: Mapping[str, float],
        entries: Mapping[str, Sequence[int]],
        ttl_s: float,
        bucket: int | None = None,
    ) -> bool:
        """``reserve`` and ``speculate`` in one round trip (pipelined): what a router sends
        after its decisions. False: the router expired (nothing applied)."""
        work = [x for field, delta in deltas.items() for x in (field, repr(float(delta)))]
        speculation = [x for rid, hashes in entries.items() if hashes for x in (rid, pack_hashes(hashes))]
        calls = [("kvmesh_reserve", router_incarnation, *work)] if work else []
        if speculation:
            bucket = speculation_bucket(ttl_s) if bucket is None else bucket
            calls.append(("kvmesh_speculate", router_incarnation, _ms(ttl_s), bucket, *speculation))
        if not calls:
            return True

        def send() -> Awaitable[list]:
            pipe = self.client.pipeline(transaction=False)
            for function, *args in calls:
                pipe.fcall(function, 0, self.ns, *args)
            return pipe.execute()

        return all(await self._with_library(send))

    # ------------------------------------------------------------------ routers' reservations

    async def register_router(self, ttl_s: float) -> int:
        """A new router incarnation, live for ``ttl_s`` unless its heartbeat extends it."""
        return int(await self._call("kvmesh_router_register", int(ttl_s * 1000)))

    async def router_heartbeat(self, router_incarnation: int, ttl_s: float) -> bool:
        """Extend it (and reap dead routers' reservations); False: it expired, register anew."""
        return bool(await self._call("kvmesh_router_heartbeat", router_incarnation, int(ttl_s * 1000)))

    async def deregister_router(self, router_incarnation: int) -> None:
        await self._call("kvmesh_router_deregister", router_incarnation)

    async def reserve(self, router_incarnation: int, deltas: Mapping[str, float]) -> bool:
        """Add ``deltas`` (``load_field(replica, "n"|"p"|"d")`` -> amount) to the fleet's and
        this router's in-flight work; False (nothing applied) if the router expired."""
        return await self.share(router_incarnation, deltas, {}, 0.0)

    async def sweep(self, cursor: int = 0, count: int = 500) -> tuple[int, int]:
        """One step of background cleanup; returns (next cursor, entries removed)."""
        next_cursor, removed = await self._call("kvmesh_sweep", cursor, count)
        return int(next_cursor), int(removed)

    async def set_controller_state(self, state: str) -> None:
        """The controller's view of its replica slots (JSON), for ``kvmesh status``."""
        await self.client.set(f"{self.ns}controller", state)

    async def controller_state(self) -> str | None:
        value = await self.client.get(f"{self.ns}controller")
        return value.decode() if value is not None else None

    async def claim_resync(self, replica_id: str, interval_s: float) -> bool:
        """True for the one router that may ask ``replica_id`` to resync in this interval
        (every router that sees the index lie about a replica would otherwise ask at once)."""
        key = f"{self.ns}resync:{replica_id}"
        return bool(await self.client.set(key, b"1", nx=True, px=max(1, int(interval_s * 1000))))

    async def snapshot(self) -> dict[str, set[int]]:
        """Every live replica's hashes, read by SCAN (O(index); for tests and debugging)."""
        live = {str(r.incarnation): r.replica_id for r in await self.live_replicas()}
        prefix = self._block_prefix
        out: dict[str, set[int]] = {rid: set() for rid in live.values()}
        async for key in self.client.scan_iter(match=prefix + b"*", count=1000):
            (h,) = np.frombuffer(key[len(prefix) :], dtype=">u8").tolist()
            for inc in await self.client.smembers(key):
                if inc.decode() in live:
                    out[live[inc.decode()]].add(h)
        return out


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def speculation_bucket(ttl_s: float) -> int:
    """The time bucket speculative entries made now share (one speculative incarnation per
    router, replica and bucket)."""
    return int(time.time() * 1000) // _ms(ttl_s)


def _matches(flat: list) -> tuple[dict[str, int], dict[str, int]]:
    """(replicas' matches, speculative matches): per replica the deepest of its entries."""
    matched: dict[str, int] = {}
    speculative: dict[str, int] = {}
    for owner, depth in zip(flat[::2], flat[1::2], strict=True):
        owner = owner.decode()
        into, rid = (speculative, owner[1:]) if owner.startswith("~") else (matched, owner)
        into[rid] = max(into.get(rid, 0), int(depth))
    return matched, speculative


def _pairs(flat: list) -> dict[str, str]:
    items = [x.decode() if isinstance(x, bytes) else str(x) for x in flat]
    return dict(zip(items[::2], items[1::2], strict=True))
