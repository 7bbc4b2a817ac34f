"""The local cluster helper: three primaries each serve their slots, and a killed primary's
replica takes over with the keys it was sent."""

import shutil

import pytest
import redis
from redis.asyncio.cluster import RedisCluster

from kvmesh.cluster.embedded_cluster import HOST, EmbeddedRedisCluster
from kvmesh.cluster.embedded_redis import default_server_binary

pytestmark = pytest.mark.servers  # starts Redis, Ray, servers or kvmesh processes

REDIS_SERVER = shutil.which("redis-server")  # Debian's 7.0 in CI


def key_per_primary(cluster: EmbeddedRedisCluster) -> dict[int, bytes]:
    """A key hashing to each primary, told apart by hash tag."""
    keys: dict[int, bytes] = {}
    for i in range(100):
        key = b"{tag%d}k" % i
        keys.setdefault(cluster.primary_for_key(key), key)
    return keys


async def test_keys_land_on_every_primary(valkey_cluster):
    keys = key_per_primary(valkey_cluster)
    assert sorted(keys) == sorted(port for _, port in valkey_cluster.primaries())
    client = RedisCluster.from_url(valkey_cluster.url)
    try:
        for port, key in keys.items():
            await client.set(key, port)
        for port, key in keys.items():
            assert await client.get(key) == b"%d" % port
            with redis.Redis(host=HOST, port=port) as primary:  # stored where primary_for_key said
                assert primary.get(key) == b"%d" % port
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    "binary",
    [
        pytest.param(default_server_binary(), id="valkey"),
        pytest.param(
            REDIS_SERVER, id="redis", marks=pytest.mark.skipif(not REDIS_SERVER, reason="no redis-server")
        ),
    ],
)
async def test_a_replicated_key_survives_its_primary(binary):
    with EmbeddedRedisCluster(binary) as cluster:
        # on the primary behind cluster.url: the client must find the cluster again through the others
        port = cluster.primaries()[0][1]
        key = key_per_primary(cluster)[port]
        client = RedisCluster.from_url(cluster.url)
        try:
            await client.set(key, b"kept")
            with redis.Redis(host=HOST, port=port) as primary:
                assert primary.execute_command("WAIT", 1, 1000) == 1  # on the replica before the crash
            promoted = cluster.kill_primary(port)
            assert port not in cluster.ports
            assert cluster.primary_for_key(key) == promoted
            assert cluster.url == f"redis://{HOST}:{promoted}"
            assert await client.get(key) == b"kept"
        finally:
            await client.aclose()
