"""The shared prefix index in Redis/Valkey (one server or a cluster), used by replicas and routers.

Every call is one round trip to server-side functions (``redis.lua`` beside this file, loaded
with ``FUNCTION LOAD`` under a name that carries its version). Replicas ``register`` (a new
incarnation each time, a stable slot per replica id), ``heartbeat`` with their load,
``publish`` their KV events in order and ``deregister``; routers ``routing_view`` (lookup + the
fleet's work) and ``share`` what they sent. The key layout is documented in ``redis.lua``:
block keys live in the slot of their chain's first block, so on a cluster different prefixes
spread over every shard and a lookup is still one call to one shard.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from importlib import resources
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import redis.asyncio as aioredis
import xxhash
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoPermissionError, RedisError, ResponseError

from kvmesh.kvcache.events import DEVICE, HOST, BlockRemoved, BlockStored, KVEvent
from kvmesh.kvcache.index.api import (
    DEFAULT_DEPLOYMENT,
    FleetWork,
    IndexSettingsError,
    IndexView,
    ReplicaRecord,
    ShareHalves,
    Speculation,
    check_settings,
    load_field,
    own_settings,
)
from kvmesh.kvcache.index.untrusted import UntrustedEntries

__all__ = [
    "DEFAULT_DEPLOYMENT",
    "INDEX_ERRORS",
    "FleetWork",
    "IndexFunctionsMissing",
    "IndexSettingsError",
    "IndexView",
    "RedisPrefixIndex",
    "ReplicaRecord",
    "connect",
    "load_field",
    "pack_hashes",
]

LAYOUT = 3  # the key layout's version: data written under another layout is never read
_SOURCE = resources.files("kvmesh.kvcache.index").joinpath("redis.lua").read_text()
VERSION = f"v{LAYOUT}_{xxhash.xxh32_hexdigest(_SOURCE.encode())}"
LIBRARY = _SOURCE.replace("@VERSION@", VERSION)
_OPS = {DEVICE: "", HOST: "h"}  # a tier's publish ops' and block keys' mark
_PUBLISH_CHUNK = 20_000  # hashes per publish call when resyncing a whole cache
_PIPELINE_CALLS = 512  # publish calls per round trip when a resync spans many roots
_SWEEP_COUNT = 500  # keys one sweep step scans on each server
MAX_SLOTS = 8192  # redis.lua's: bitmaps stay <= 1 KiB
# redis.lua's check of an address, for records it did not write (raw writes by a replica's user)
_HOST_PORT = re.compile(r"[A-Za-z0-9.\-\[\]:/]+:[0-9]+")
# A record's names that readers turn into metric labels and log fields (replica id, hardware):
# printable ASCII on one line, short, so a raw write cannot swell every scrape and log line.
_NAME = re.compile(r"[ -~]{1,128}")


T = TypeVar("T")
# What a call to the index raises when Redis is away, slow or refuses: callers degrade on these.
INDEX_ERRORS = (RedisError, OSError, asyncio.TimeoutError)


class IndexFunctionsMissing(RedisError):
    """The server has no index functions of this release and this client may not load them
    (an index outage until the deployment's admin loads them)."""


def function(name: str) -> str:
    """The server-side name of one of this release's index functions."""
    return f"kvmesh_{VERSION}_{name}"


def pack_hashes(hashes: Iterable[int]) -> bytes:
    """Block hashes as the index's 8-byte big-endian keys."""
    return np.fromiter(hashes, dtype=">u8").tobytes()


def _digest(model_id: str, deployment: str) -> str:
    """8 hex digits naming one deployment of one model under this key layout."""
    return f"{xxhash.xxh32_intdigest(chr(0).join((str(LAYOUT), model_id, deployment)).encode()):08x}"


def connect(
    url: str,
    timeout: float = 2.0,
    *,
    username: str | None = None,
    password: str | None = None,
    ca_file: str | None = None,
) -> aioredis.Redis | RedisCluster:
    """A client that fails fast: callers decide how to degrade when Redis is away.

    ``redis://``, ``rediss://`` (TLS, verified against ``ca_file`` when given) or ``unix://``;
    ``redis+cluster://`` / ``rediss+cluster://`` name any node of a Valkey/Redis Cluster (the
    client discovers the rest). ``password`` (and ACL ``username``) apply when the URL carries
    none, so secrets can stay out of URLs, flags and logs.
    """
    extra: dict[str, object] = {}
    parts = urlsplit(url)
    scheme, cluster = parts.scheme.removesuffix("+cluster"), parts.scheme.endswith("+cluster")
    if scheme not in ("redis", "rediss") and not (scheme == "unix" and not cluster):
        raise ValueError(
            "not a Redis URL (redis://, rediss://, unix://, redis+cluster:// or rediss+cluster://): "
            f"{parts.scheme}://..."
        )
    if not parts.password and password:
        extra["password"] = password
        if username:
            extra["username"] = username
    if scheme == "rediss" and ca_file:
        extra["ssl_ca_certs"] = ca_file
    if cluster:
        return RedisCluster.from_url(
            urlunsplit(parts._replace(scheme=scheme)),
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            **extra,
        )
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=10,
        **extra,
    )


class RedisPrefixIndex(ShareHalves):
    """One deployment of one model's index on a Redis/Valkey server or cluster."""

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        model_id: str,
        block_size: int | None,
        hash_seed: int | None,
        deployment: str = DEFAULT_DEPLOYMENT,
        members_max_age_s: float = 1.0,
    ):
        """``block_size``/``hash_seed`` None: a client that never stores the settings (it may
        read them: a router whose block size is "auto", a supervisor, a status tool).
        ``deployment``: which deployment of the model this is (its replicas, routers and
        index entries are its own). ``members_max_age_s``: how old the live replicas this
        client read may be when it turns a lookup's slots into replica ids."""
        self.client = client
        self.model_id = model_id
        self.deployment = deployment
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.digest = digest = _digest(model_id, deployment)  # names this deployment's keys
        self.ns = f"{{k:{digest}}}"  # the control keys' hash-tagged prefix (membership, routers' work)
        self._ns_key = self.ns.encode()
        self.block_pattern = f"{{{digest}.*".encode()
        self._tag_prefix = f"{{{digest}.".encode()
        self.block_key_length = len(self.tag(0)) + 8
        self._load_key = f"{self.ns}load".encode()
        self._loaded = False
        self.may_load_library = True  # False once the server said this client's user may not
        self._clustered = isinstance(client, RedisCluster)
        self.members_max_age_s = members_max_age_s
        self._by_slot: dict[int, ReplicaRecord] = {}
        self._slot_of: dict[str, int] = {}
        self._members_at = -float("inf")
        self._known_slots: set[int] = set()  # live and dead slots when the members were last read
        self._own_slots: dict[tuple[str, int], int] = {}  # (replica, incarnation) -> slot, from register
        self._sweep_cursors: dict[str, int | None] = {}  # server -> SCAN cursor; None: done this pass
        self._pass_began: int | None = None  # server ms when this client's current sweep pass began
        self.untrusted = UntrustedEntries()  # what it read and skipped
        self._url: str | None = None  # from_url's, to connect again (``reconnect``)
        self._credentials: dict[str, str | None] = {}

    @classmethod
    def from_url(
        cls,
        url: str,
        model_id: str,
        block_size: int | None,
        hash_seed: int | None,
        deployment: str = DEFAULT_DEPLOYMENT,
        members_max_age_s: float = 1.0,
        **credentials: str | None,
    ) -> RedisPrefixIndex:
        """``credentials``: ``username``, ``password``, ``ca_file`` (see ``connect``)."""
        index = cls(
            connect(url, **credentials), model_id, block_size, hash_seed, deployment, members_max_age_s
        )
        index._url, index._credentials = url, credentials
        return index

    async def reconnect(self, username: str, password: str) -> None:
        """Go on as another user (a replica whose supervisor issued it a new password): new
        calls use a new client, and the old one closes."""
        if self._url is None:
            raise RuntimeError("only an index made by from_url can connect again")
        credentials = {**self._credentials, "username": username, "password": password}
        old, self.client = self.client, connect(self._url, **credentials)
        await old.aclose()

    async def close(self) -> None:
        await self.client.aclose()

    def tag(self, root: int) -> bytes:
        """The key prefix (hash tag) of every block of the chains starting at ``root``."""
        return self._tag_prefix + f"{root & 0xFFFF:04x}}}".encode()

    def block_key(self, root: int, block_hash: int) -> bytes:
        return self.tag(root) + pack_hashes((block_hash,))

    async def _control(self, name: str, *args, read_only: bool = False):
        """One call to a control function (its key: this deployment's namespace)."""
        fcall = self.client.fcall_ro if read_only else self.client.fcall
        return await self._with_library(lambda: fcall(function(name), 1, self._ns_key, *args))

    async def load_functions(self) -> bool:
        """Load this release's index functions now (the deployment's admin does, at start, so
        that routers and replicas whose users may not find them there); False where this
        client's user may not."""
        await self._load_library()
        return self.may_load_library

    async def _load_library_once(self) -> None:
        if not self._loaded:
            await self._load_library()

    async def _load_library(self) -> None:
        """FUNCTION LOAD this release's library (only it: another release's stays). Where this
        client's Redis user may not (routers and replicas behind ACL users), the deployment's
        admin loads it, and a call finds it missing only if the admin has not yet."""
        try:
            await self.client.function_load(LIBRARY, replace=True)
            self.may_load_library = True
        except NoPermissionError:
            self.may_load_library = False
        self._loaded = True

    async def _reload_library(self) -> None:
        """The server lost the library (new, restarted, a node that joined): load it again,
        unless this client's user was refused once already (no 20 KB resent per failed call)."""
        if self.may_load_library:
            await self._load_library()
        if not self.may_load_library:
            raise IndexFunctionsMissing(
                f"the index functions of this kvmesh release ({VERSION}) are not on the server, and this "
                "process's Redis user may not load them: the deployment's admin user does (kvmesh up, the "
                "chart's controller)"
            )

    async def _with_library(self, send: Callable[[], Awaitable[T]]) -> T:
        """``send()``, loading the library first if this client has not, and again if the
        server lost it."""
        await self._load_library_once()
        try:
            return await send()
        except ResponseError as exc:
            if not _function_lost(exc):
                raise
            await self._reload_library()
            return await send()

    async def _pipeline(self, commands: list[tuple[str, ...]]) -> list:
        """(method, *args) commands in one round trip. Those that failed (their server lost
        the library, or went away: a failover) are sent once more, after loading the library,
        and only those: on a cluster the others (a reservation, say) were applied already."""
        await self._load_library_once()
        replies = await self._send(commands, raise_on_error=False)
        failed = [i for i, reply in enumerate(replies) if isinstance(reply, Exception)]
        if failed:
            refused = [replies[i] for i in failed if isinstance(replies[i], ResponseError)]
            if any(not _function_lost(error) for error in refused):
                raise next(error for error in refused if not _function_lost(error))
            if refused:
                await self._reload_library()
            again = await self._send([commands[i] for i in failed], raise_on_error=True)
            for i, reply in zip(failed, again, strict=True):
                replies[i] = reply
        return replies

    async def _send(self, commands: list[tuple[str, ...]], raise_on_error: bool) -> list:
        pipe = self.client.pipeline(transaction=False)
        for method, *args in commands:
            getattr(pipe, method)(*args)
        return await pipe.execute(raise_on_error=raise_on_error)

    # ------------------------------------------------------------------ settings

    async def ensure_settings(self) -> None:
        """Store the settings if the index has none (the admin's, or the first replica's);
        IndexSettingsError when it has others. Routers only read them (``settings``): their
        user may not write them."""
        mine = own_settings(self.model_id, self.deployment, self.block_size, self.hash_seed)
        stored = await self._control("settings", *[x for kv in mine.items() for x in kv])
        check_settings(mine, _pairs(stored))

    async def settings(self) -> dict[str, str] | None:
        """The settings the admin or the first replica stored, None while there are none
        (text as read, what does not decode replaced: a caller compares, never trusts)."""
        stored = await self.client.hgetall(f"{self.ns}settings")
        return {_text(k, lenient=True): _text(v, lenient=True) for k, v in stored.items()} or None

    async def has_settings(self) -> bool:
        """False when the server lost this model's data (restarted without persistence)."""
        return bool(await self._control("has_settings", read_only=True))

    # ------------------------------------------------------------------ replicas

    async def register(
        self, replica_id: str, address: str, ttl_s: float, info: Mapping[str, object] = ()
    ) -> int:
        """Start a new incarnation (retiring the previous one); returns its number."""
        fields = {"address": address, "started_at": time.time(), "heartbeat_at": time.time(), **dict(info)}
        flat = [str(x) for kv in fields.items() for x in kv]
        incarnation, slot = await self._control("register", replica_id, _ms(ttl_s), *flat)
        self._own_slots[(replica_id, int(incarnation))] = int(slot)
        self._members_at = -float("inf")  # what this client reads next includes it
        return int(incarnation)

    async def heartbeat(
        self, replica_id: str, incarnation: int, ttl_s: float, load: Mapping[str, object] = ()
    ) -> bool:
        """Extend liveness and store load; False means the incarnation was retired or expired."""
        flat = [str(x) for kv in {"heartbeat_at": time.time(), **dict(load)}.items() for x in kv]
        return bool(await self._control("heartbeat", replica_id, incarnation, _ms(ttl_s), *flat))

    async def deregister(self, replica_id: str, incarnation: int) -> bool:
        self._own_slots.pop((replica_id, incarnation), None)
        self._members_at = -float("inf")
        return bool(await self._control("deregister", replica_id, incarnation))

    async def retire(self, replica_id: str) -> bool:
        """End a replica's current incarnation now (a supervisor saw its process die)."""
        self._members_at = -float("inf")
        return bool(await self._control("retire", replica_id))

    async def live_replicas(self) -> list[ReplicaRecord]:
        return (await self._members())[0]

    async def _members(self) -> tuple[list[ReplicaRecord], list[int]]:
        """(live replicas, slots that no live incarnation owns); refreshes the slot map that
        lookups read."""
        raw = await self._control("live_replicas", read_only=True)
        records = []
        for flat, ttl in zip(raw[1::2], raw[2::2], strict=True):
            record = self._record(flat, ttl)
            if record is not None:
                records.append(record)
        dead = [slot for slot in map(_integer, raw[0]) if slot is not None]
        self._by_slot = {r.slot: r for r in records}
        self._slot_of = {r.replica_id: r.slot for r in records}
        self._known_slots = set(self._by_slot) | set(dead)
        self._members_at = time.monotonic()
        return records, dead

    async def _fresh_members(self) -> None:
        if time.monotonic() - self._members_at > self.members_max_age_s:
            await self._members()

    def _record(self, flat: list, ttl: object) -> ReplicaRecord | None:
        """One replica's record as read, or None (counted, logged once) when it is not one
        kvmesh wrote: any process with the replica role can write any bytes there, and one
        bad record must cost only itself, never a decision or the other records."""
        try:
            fields = dict(zip(map(_text, flat[::2]), map(_text, flat[1::2]), strict=True))
            record = ReplicaRecord(
                replica_id=fields.pop("replica_id"),
                address=fields.pop("address"),
                incarnation=_integer(fields.pop("incarnation"), strict=True),
                heartbeat_ttl_ms=_integer(ttl, strict=True),
                fields=fields,
                slot=_integer(fields.pop("slot"), strict=True),
            )
            if not 0 <= record.slot < MAX_SLOTS or not _HOST_PORT.fullmatch(record.address):
                raise ValueError("its slot or address is out of shape")
            if not _NAME.fullmatch(record.replica_id) or not _NAME.fullmatch(fields.get("hardware", "-")):
                raise ValueError("its replica id or hardware is not a short printable name")
        except (KeyError, ValueError, TypeError) as exc:
            named = dict(zip(flat[::2], flat[1::2], strict=False)).get(b"replica_id", b"?")
            self.untrusted.reject("record", _text(named, lenient=True), exc)
            return None
        return record

    # ------------------------------------------------------------------ blocks

    async def _own_slot(self, replica_id: str, incarnation: int) -> int | None:
        slot = self._own_slots.get((replica_id, incarnation))
        if slot is None:  # registered through another client: read it from the record
            record = await self.client.hmget(f"{self.ns}r:{replica_id}", ["incarnation", "slot"])
            if _integer(record[0]) != incarnation or _integer(record[1]) is None:
                return None  # retired, or its record was overwritten: resync under a new one
            slot = self._own_slots[(replica_id, incarnation)] = _integer(record[1])
        return slot

    async def publish(self, replica_id: str, incarnation: int, events: Iterable[KVEvent]) -> bool:
        """Apply Stored/Removed events in order (one call per chain root, pipelined); False:
        the incarnation is no longer live (what it wrote never counts: resync under a new one).

        ``AllBlocksCleared`` is not handled here: the publisher starts a new incarnation.
        """
        ops: dict[bytes, list] = {}  # tag -> [op, packed, op, packed ...], in event order
        for event in events:
            if isinstance(event, BlockStored):
                pairs, op = [(event.root, h) for h in event.hashes], _OPS[event.medium] + "+"
            elif isinstance(event, BlockRemoved):
                pairs, op = list(zip(event.roots, event.hashes, strict=True)), _OPS[event.medium] + "-"
            else:
                raise TypeError(f"publish takes BlockStored/BlockRemoved, got {event!r}")
            for root, h in pairs:
                args = ops.setdefault(self.tag(root), [])
                if args and args[-2] == op:
                    args[-1] += pack_hashes((h,))
                else:
                    args += [op, pack_hashes((h,))]
        if not ops:
            return True
        return await self._publish_calls(replica_id, incarnation, list(ops.items()))

    async def publish_all(
        self, replica_id: str, incarnation: int, blocks: Mapping[int, int], host: Mapping[int, int] = {}
    ) -> bool:
        """Publish a whole cache (``hash -> root``: a resync; ``host``: its host tier's), a
        bounded call per root chunk, pipelined, so no single call blocks Redis for long."""
        calls = []
        for op, tier in (("+", blocks), ("h+", host)):
            by_tag: dict[bytes, list[int]] = {}
            for h, root in tier.items():
                by_tag.setdefault(self.tag(root), []).append(h)
            calls += [
                (tag, [op, pack_hashes(hashes[i : i + _PUBLISH_CHUNK])])
                for tag, hashes in by_tag.items()
                for i in range(0, len(hashes), _PUBLISH_CHUNK)
            ]
        return await self._publish_calls(replica_id, incarnation, calls)

    async def _publish_calls(
        self, replica_id: str, incarnation: int, calls: list[tuple[bytes, list]]
    ) -> bool:
        """Send (tag, [op, packed, ...]) groups: on one server, as few calls as the chunk size
        allows; on a cluster, one call per tag (its slot's shard). Pipelined, with a check that
        the incarnation is still live."""
        slot = await self._own_slot(replica_id, incarnation)
        if slot is None:
            return False
        triples = [
            [tag, op, packed] for tag, args in calls for op, packed in zip(args[::2], args[1::2], strict=True)
        ]
        batches: list[list] = []
        size = _PUBLISH_CHUNK * 8 + 1  # bytes of hashes in the last batch: start a new one
        for tag, op, packed in triples:
            if self._clustered or size + len(packed) > _PUBLISH_CHUNK * 8:
                batches.append([])
                size = 0
            batches[-1] += [tag, op, packed]
            size += len(packed)
        for start in range(0, max(1, len(batches)), _PIPELINE_CALLS):
            calls = [
                ("fcall", function("publish"), 1, args[0], slot, *args)
                for args in batches[start : start + _PIPELINE_CALLS]
            ]
            calls.append(("get", f"{self.ns}l:{replica_id}"))  # still live? (a control key: its own shard)
            replies = await self._pipeline(calls)
            if _integer(replies[-1]) != incarnation:
                return False
        return True

    def _chain(self, block_hashes: Sequence[int]) -> tuple[bytes, bytes] | None:
        """(first block key, the packed chain) of a lookup, None for an empty chain."""
        if not block_hashes:
            return None
        return self.block_key(block_hashes[0], block_hashes[0]), pack_hashes(block_hashes)

    async def lookup(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Matched leading blocks per live replica holding at least the first block (what the
        replicas published; routers' speculative entries are left out). Live: as of the
        records this client read at most ``members_max_age_s`` ago, or since (see ``_matches``)."""
        chain = self._chain(block_hashes)
        if chain is None:
            return {}
        await self._fresh_members()
        flat = await self._with_library(lambda: self.client.fcall_ro(function("lookup"), 1, *chain))
        return (await self._matches(flat))[0]

    async def routing_view(self, block_hashes: Sequence[int]) -> IndexView:
        """Everything a routing decision reads, in one round trip: the replicas' matches, the
        routers' speculative matches (one call to the chain's shard) and every router's
        in-flight work per replica (a plain HGETALL of the control slot, pipelined)."""
        chain = self._chain(block_hashes)
        await self._fresh_members()
        lookup = [("fcall_ro", function("lookup"), 1, *chain)] if chain is not None else []
        replies = await self._pipeline([*lookup, ("hgetall", self._load_key)])
        flat, load = (replies[0], replies[1]) if chain is not None else ([], replies[0])
        matched, speculative, tiered = await self._matches(flat)
        return IndexView(matched, speculative, self._fleet(load), tiered)

    async def _matches(self, flat: list) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """(replicas' device matches, speculative matches, matches counting host tiers) from a
        lookup's (depth, published, speculative, tiered bitmap) groups, slots mapped to the
        live replicas that own them. A slot this client has never seen (a replica just
        restarted or joined) makes it read the members again first, so a resync counts from
        its first lookup."""
        groups = [
            (int(depth), [_slots(bitmap) for bitmap in bitmaps])
            for depth, *bitmaps in zip(flat[::4], flat[1::4], flat[2::4], flat[3::4], strict=True)
        ]
        if any(slot not in self._known_slots for _, (_, _, tiered) in groups for slot in tiered):
            await self._members()
        found: tuple[dict[str, int], dict[str, int], dict[str, int]] = ({}, {}, {})
        for depth, bitmaps in groups:
            for into, slots in zip(found, bitmaps, strict=True):
                for slot in slots:
                    record = self._by_slot.get(slot)
                    if record is not None:
                        into[record.replica_id] = depth
        return found

    def _fleet(self, load: Mapping[bytes, bytes]) -> dict[str, FleetWork]:
        """The load hash (replica id -> "<requests> <prefill> <decode>") as work per replica;
        an entry that does not parse is skipped (counted, logged once): routers may write it."""
        fleet = {}
        for rid, work in load.items():
            try:
                numbers = [float(x) for x in work.split()]
                if len(numbers) != 3 or not all(math.isfinite(x) for x in numbers):
                    raise ValueError("not three finite numbers")
                fleet[_text(rid)] = FleetWork(*(max(0.0, x) for x in numbers))
            except ValueError as exc:
                self.untrusted.reject("load", _text(rid, lenient=True), exc)
        return fleet

    async def share(
        self,
        router_incarnation: int,
        deltas: Mapping[str, float],
        entries: Iterable[Speculation],
        ttl_s: float,
    ) -> bool:
        """``reserve`` and ``speculate`` in one round trip (pipelined): what a router sends
        after its decisions. False: the router expired (no work applied)."""
        work = [x for field, delta in deltas.items() for x in (field, repr(float(delta)))]
        await self._fresh_members()
        by_tag: dict[bytes, list] = {}
        for replica_id, root, hashes in entries:
            slot = self._slot_of.get(replica_id)
            if hashes and slot is not None:  # a replica not live has no slot to mark
                by_tag.setdefault(self.tag(root), []).extend((slot, pack_hashes(hashes)))

        calls = [("fcall", function("reserve"), 1, self._ns_key, router_incarnation, *work)]
        calls += [("fcall", function("speculate"), 1, tag, _ms(ttl_s), *args) for tag, args in by_tag.items()]
        return bool((await self._pipeline(calls))[0])

    # ------------------------------------------------------------------ routers' reservations

    async def register_router(self, ttl_s: float) -> int:
        """A new router incarnation, live for ``ttl_s`` unless its heartbeat extends it."""
        return int(await self._control("router_register", _ms(ttl_s)))

    async def router_heartbeat(self, router_incarnation: int, ttl_s: float) -> int:
        """Extend it (and reap dead routers' reservations); how many routers are registered
        then, itself included (0: it expired, register anew). One round trip."""
        return int(await self._control("router_heartbeat", router_incarnation, _ms(ttl_s)))

    async def deregister_router(self, router_incarnation: int) -> None:
        await self._control("router_deregister", router_incarnation)

    # ------------------------------------------------------------------ upkeep

    def _servers(self) -> list[tuple[str, dict]]:
        """(name, how to address it) of every server holding block keys: the primaries of a
        cluster, or the one server."""
        if not self._clustered:
            return [("server", {})]
        return [(node.name, {"target_nodes": node}) for node in self.client.get_primaries()]

    async def sweep(self) -> int:
        """One step of background cleanup: on every server still in this client's current
        pass, a SCAN of up to 500 block keys clearing the bits of slots whose incarnation
        ended. Once every server's keys were visited, slots dead well before the pass began are
        freed. Returns the bits cleared."""
        began, dead = await self._control("sweep_plan", read_only=True)
        servers = dict(self._servers())
        if self._pass_began is None or self._sweep_cursors.keys() != servers.keys():
            self._pass_began = int(began)  # a new pass (or the primaries changed: start over)
            self._sweep_cursors = dict.fromkeys(servers, 0)
        cleared = 0
        for name, cursor in self._sweep_cursors.items():
            if cursor is None:
                continue  # this server's keys were all visited in this pass

            def send(cursor: int = cursor, where: dict = servers[name]) -> Awaitable[list]:
                args = (self.block_pattern, self.block_key_length, cursor, _SWEEP_COUNT, *dead)
                return self.client.execute_command("FCALL", function("sweep"), 0, *args, **where)

            next_cursor, count = await self._with_library(send)
            self._sweep_cursors[name] = int(next_cursor) or None
            cleared += int(count)
        if all(cursor is None for cursor in self._sweep_cursors.values()):
            await self._control("swept", self._pass_began)
            self._pass_began = None
        return cleared

    async def set_controller_state(self, state: str) -> None:
        """The controller's view of its replica slots (JSON), for ``kvmesh status``."""
        await self.client.set(f"{self.ns}controller", state)

    async def controller_state(self) -> str | None:
        value = await self.client.get(f"{self.ns}controller")
        return _text(value, lenient=True) if value is not None else None

    async def claim_resync(self, replica_id: str, interval_s: float) -> bool:
        """True for the one router that may ask ``replica_id`` to resync in this interval
        (every router that sees the index lie about a replica would otherwise ask at once)."""
        key = f"{self.ns}resync:{replica_id}"
        return bool(await self.client.set(key, b"1", nx=True, px=_ms(interval_s)))

    async def snapshot(self, medium: str = DEVICE) -> dict[str, set[int]]:
        """Every live replica's hashes in one tier, read by SCAN (O(index); for tests and
        debugging)."""
        records = await self.live_replicas()
        out: dict[str, set[int]] = {r.replica_id: set() for r in records}
        owner = {r.slot: r.replica_id for r in records}
        tier = _OPS[medium].encode()
        async for key in self.client.scan_iter(match=self.block_pattern, count=1000):
            if len(key) == self.block_key_length + len(tier) and key[:-8].endswith(tier or b"}"):
                (h,) = np.frombuffer(key[-8:], dtype=">u8").tolist()
                for slot in _slots(await self.client.get(key) or b""):
                    if slot in owner:
                        out[owner[slot]].add(h)
        return out


def _function_lost(reply: object) -> bool:
    """Whether a reply is the error of a server that does not have the function (any more)."""
    text = str(reply).lower()
    return isinstance(reply, ResponseError) and "function" in text and "not found" in text


def _slots(bitmap: bytes) -> list[int]:
    """The slots set in a bitmap (bit 0 = the first byte's most significant bit, as SETBIT
    numbers them)."""
    return np.flatnonzero(np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8))).tolist()


def _text(value: object, lenient: bool = False) -> str:
    """A stored value as text: UTF-8, or (``lenient``, for messages and keys of skipped
    entries) with what does not decode replaced."""
    if isinstance(value, bytes):
        return value.decode(errors="replace" if lenient else "strict")
    return str(value)


def _integer(value: object, strict: bool = False) -> int | None:
    """A stored integer; None (ValueError when ``strict``) when it is not one."""
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        if strict:
            raise ValueError(f"not an integer: {value!r:.40}") from None
        return None


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _pairs(flat: list) -> dict[str, str]:
    items = [_text(x, lenient=True) for x in flat]
    return dict(zip(items[::2], items[1::2], strict=False))
