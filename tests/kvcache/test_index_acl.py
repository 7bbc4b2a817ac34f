"""The index behind ACL users (issue: "the index trusts every client"): each role can do its
own work through the real index client, and is refused everything else, on Valkey and Redis 7."""

import pytest
from redis.exceptions import AuthenticationError, ResponseError

from kvmesh.kvcache import BlockStored
from kvmesh.kvcache.events import HOST
from kvmesh.kvcache.index.acl import (
    ROLES,
    USERS,
    acl_file,
    acl_rules,
    issue_replica_user,
    replica_user,
    replica_users,
)
from kvmesh.kvcache.index.redis import IndexFunctionsMissing, RedisPrefixIndex, connect, function, pack_hashes

pytestmark = pytest.mark.asyncio(loop_scope="module")
CHAIN = [11, 12, 13]


def refused():
    """A refusal by the server's ACL: NOPERM, or (inside a function) Valkey's "ACL failure"
    and Redis's "can't run / can't access"."""
    return pytest.raises(ResponseError, match=r"(?i)no permissions|acl failure|can.t access|can.t run")


def as_role(server_and_passwords, role: str, deployment: str) -> RedisPrefixIndex:
    server, passwords = server_and_passwords
    return RedisPrefixIndex.from_url(
        server.url, "m", 16, 7, deployment, username=USERS[role], password=passwords[role]
    )


async def test_each_role_does_its_own_work(acl_server):
    admin = as_role(acl_server, "admin", "work")
    router, replica = as_role(acl_server, "router", "work"), as_role(acl_server, "replica", "work")
    try:
        assert await admin.load_functions()
        assert not await router.load_functions() and not await replica.load_functions()
        await replica.ensure_settings()
        incarnation = await replica.register("r0", "10.0.0.1:5000", ttl_s=5)
        await replica.publish("r0", incarnation, [BlockStored(tuple(CHAIN[:2]), None, 16, CHAIN[0])])
        await replica.publish(
            "r0", incarnation, [BlockStored(tuple(CHAIN[2:]), CHAIN[1], 16, CHAIN[0], HOST)]
        )
        assert await replica.heartbeat("r0", incarnation, ttl_s=5, load={"num_running": 1})
        await replica.sweep()
        rinc = await router.register_router(ttl_s=5)
        assert [r.replica_id for r in await router.live_replicas()] == ["r0"]
        assert (await router.lookup(CHAIN)).get("r0") == 2
        assert (await router.routing_view(CHAIN)).tiered == {"r0": 3}  # its host tier's block too
        await router.speculate(rinc, [("r0", CHAIN[0], CHAIN)], ttl_s=1)
        assert await router.claim_resync("r0", 1.0)
        assert await router.router_heartbeat(rinc, ttl_s=5)
        assert await replica.deregister("r0", incarnation)
        assert await admin.retire("r0") is False  # the controller's duty (admin): nothing left to retire
    finally:
        for index in (admin, router, replica):
            await index.close()


async def test_a_router_cannot_pose_as_a_replica_or_change_the_server(acl_server):
    admin, router = as_role(acl_server, "admin", "attack"), as_role(acl_server, "router", "attack")
    try:
        await admin.load_functions()
        with refused():  # an impostor's address would get the prompts
            await router.register("r0", "10.6.6.6:5000", ttl_s=5)
        with refused():  # a function call is checked like the commands it runs
            await router.client.fcall(
                function("publish"), 1, router.tag(11), 0, router.tag(11), "+", pack_hashes(CHAIN)
            )
        assert await router.live_replicas() == []  # and nothing half-written
        with refused():  # the settings: a router's would keep every replica out
            await router.client.hset(f"{router.ns}settings", "block_size", "32")
        with refused():
            await router.ensure_settings()
        for command in (
            ("FUNCTION", "FLUSH"),
            ("FLUSHALL",),
            ("CONFIG", "SET", "maxmemory", "1"),
            ("KEYS", "*"),
        ):
            with refused():
                await router.client.execute_command(*command)
    finally:
        await admin.close()
        await router.close()


async def test_a_replica_cannot_steer_routing_or_change_the_server(acl_server):
    admin, replica = as_role(acl_server, "admin", "steer"), as_role(acl_server, "replica", "steer")
    router = as_role(acl_server, "router", "steer")
    try:
        await admin.load_functions()
        with refused():  # shared load and speculation are the routers'
            await replica.register_router(ttl_s=5)
        with refused():
            await replica.client.fcall(function("speculate"), 1, replica.tag(11), 2000, 0, pack_hashes(CHAIN))
        rinc = await router.register_router(ttl_s=5)  # a real router's incarnation, live
        with refused():
            await replica.client.fcall(function("reserve"), 1, replica.ns, rinc, "r0|n", 1)
        with refused():
            await replica.claim_resync("r0", 1.0)
        for command in (("FUNCTION", "LOAD", "REPLACE", "#!lua name=x\n"), ("FLUSHDB",), ("ACL", "LIST")):
            with refused():
                await replica.client.execute_command(*command)
    finally:
        for index in (admin, router, replica):
            await index.close()


async def test_without_credentials_nothing_answers(acl_server):
    server, passwords = acl_server
    anonymous = connect(server.url)
    wrong = connect(server.url, username=USERS["admin"], password=passwords["router"])
    try:
        with pytest.raises(AuthenticationError):
            await anonymous.get("x")
        with pytest.raises(AuthenticationError):
            await wrong.get("x")
    finally:
        await anonymous.aclose()
        await wrong.aclose()


async def test_functions_only_the_admin_can_load_are_an_index_outage_until_it_does(acl_server):
    admin, router = as_role(acl_server, "admin", "outage"), as_role(acl_server, "router", "outage")
    try:
        await admin.client.function_flush()
        with pytest.raises(IndexFunctionsMissing, match="admin"):
            await router.live_replicas()
        assert await admin.load_functions()
        assert await router.live_replicas() == []
    finally:
        await admin.close()
        await router.close()


async def test_acl_file_holds_hashes_not_passwords_and_refuses_gaps():
    passwords = {role: f"pw-{role}-secret" for role in ROLES}
    text = acl_file(passwords)
    assert "user default off" in text and all(p not in text for p in passwords.values())
    assert text.count("\nuser kvmesh-") == 3
    with pytest.raises(ValueError, match="replica"):
        acl_file({"admin": "a", "router": "b"})
    with pytest.raises(ValueError, match="spaces"):
        acl_file({**passwords, "router": "two words"})
    with pytest.raises(ValueError, match="unknown"):
        acl_rules("guest")


async def test_a_replicas_own_user_serves_itself_and_cannot_pose_as_or_move_another(acl_server):
    """Issue 48: every replica shared one user, so one could re-register another at an address
    of its choosing (and the router sends the replica token wherever it dials)."""
    server, _ = acl_server
    admin = as_role(acl_server, "admin", "own-users")
    try:
        await admin.load_functions()
        await admin.ensure_settings()
        users = {rid: await issue_replica_user(admin.client, admin.digest, rid) for rid in ("r0", "r1")}
        assert await replica_users(admin.client) >= {replica_user(admin.digest, r) for r in ("r0", "r1")}
        own = {
            rid: RedisPrefixIndex.from_url(server.url, "m", 16, 7, "own-users", username=u, password=p)
            for rid, (u, p) in users.items()
        }
        incarnations = {
            rid: await own[rid].register(rid, f"10.0.0.{i}:5000", ttl_s=5) for i, rid in enumerate(own)
        }
        await own["r0"].publish("r0", incarnations["r0"], [BlockStored(tuple(CHAIN), None, 16, CHAIN[0])])
        await own["r0"].publish(
            "r0", incarnations["r0"], [BlockStored(tuple(CHAIN), None, 16, CHAIN[0], HOST)]
        )
        assert await own["r0"].heartbeat("r0", incarnations["r0"], ttl_s=5)
        await own["r0"].sweep()
        with refused():  # its address would get r1's prompts, and the replica token
            await own["r0"].register("r1", "10.6.6.6:5000", ttl_s=5)
        with refused():
            await own["r0"].client.hset(f"{own['r0'].ns}r:r1", "address", "10.6.6.6:5000")
        with refused():  # nor end r1's incarnation
            await own["r0"].client.delete(f"{own['r0'].ns}l:r1")
        with refused():
            await own["r0"].deregister("r1", incarnations["r1"])
        u, pw = users["r0"]
        elsewhere = RedisPrefixIndex.from_url(server.url, "m", 16, 7, "another", username=u, password=pw)
        with refused():  # another deployment's replica-0 is not it (two kvmesh up on one Redis)
            await elsewhere.register("r0", "10.6.6.6:5000", ttl_s=5)
        await elsewhere.close()
        records = {r.replica_id: r.address for r in await admin.live_replicas()}
        assert records == {"r0": "10.0.0.0:5000", "r1": "10.0.0.1:5000"}
        assert await own["r1"].deregister("r1", incarnations["r1"])
        _, renewed = await issue_replica_user(
            admin.client, admin.digest, "r0"
        )  # a new password: the old one is gone
        with pytest.raises(AuthenticationError):
            await connect(server.url, username=users["r0"][0], password=users["r0"][1]).ping()
        await own["r0"].reconnect(users["r0"][0], renewed)
        assert await own["r0"].heartbeat("r0", incarnations["r0"], ttl_s=5)
        for index in own.values():
            await index.close()
    finally:
        await admin.close()


async def test_a_replica_id_that_is_not_plain_gets_no_user_of_its_own():
    with pytest.raises(ValueError, match="letters"):
        replica_user("0123abcd", "r*")
    rules = acl_rules("replica", ("0123abcd", "r0")).split()
    assert "~{k:0123abcd}r:r0" in rules and "~{0123abcd.????}????????" in rules
    assert not any("{k:????????}" in rule for rule in rules)  # no other deployment's keys
