"""rpc.redis_connect: every URL form reaches a real Redis (standalone, a Cluster by seed nodes);
bad URLs are one clear ValueError; a namespace's keys share a slot and namespaces spread."""

from __future__ import annotations

import asyncio

import pytest
import redis

from events.logkeys import LogKeys
from rpc.redis_connect import client_url, connect, connect_async, is_cluster, parse
from tests.support.redis_cluster import RedisCluster


@pytest.mark.parametrize(("url", "kind", "nodes", "service"), [
    ("redis://127.0.0.1:6379/0", "standalone", (), ""),
    ("unix:///tmp/redis.sock", "standalone", (), ""),
    ("redis+cluster://a:7000,b:7001", "cluster", (("a", 7000), ("b", 7001)), ""),
    ("redis://a:7000,b", "cluster", (("a", 7000), ("b", 6379)), ""),
    ("rediss+cluster://u:pw@a:7000", "cluster", (("a", 7000),), ""),
    ("redis+sentinel://s1,s2:26380/kvd/2", "sentinel", (("s1", 26379), ("s2", 26380)), "kvd"),
])
def test_parse_forms(url: str, kind: str, nodes: tuple[tuple[str, int], ...], service: str) -> None:
    target = parse(url)
    assert (target.kind, target.nodes, target.service) == (kind, nodes, service)


def test_parse_keeps_credentials_and_hides_them() -> None:
    target = parse("rediss+cluster://user:secret@a:7000?socket_timeout=2")
    assert target.options["username"] == "user" and target.options["password"] == "secret"
    assert target.options["socket_timeout"] == 2.0
    assert "secret" not in target.describe()


@pytest.mark.parametrize(("url", "why"), [
    ("http://a:1", "not a Redis URL"),
    ("redis+cluster://a:x", "bad host:port"),
    ("redis+cluster://a:1/3", "only db 0"),
    ("redis+sentinel://a:1", "names its service"),
    ("redis+sentinel://:pw@a:1", "names its service"),
])
def test_bad_urls_are_one_clear_error(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as exc:
        parse(url)
    assert "pw" not in str(exc.value)


def test_standalone_clients(redis_url: str) -> None:
    client = connect(redis_url)
    assert not is_cluster(client) and client.ping()
    assert client_url(client).startswith("redis://127.0.0.1:")
    client.close()

    async def ping() -> bool:
        aclient = connect_async(redis_url)
        try:
            return bool(await aclient.ping())
        finally:
            await aclient.aclose()
    assert asyncio.run(ping())


def test_cluster_clients_and_slots(tmp_path: object, shared_cluster: RedisCluster) -> None:
    cluster = shared_cluster
    client = connect(cluster.url.split(",")[0])  # one seed is enough
    assert is_cluster(client)
    keys = LogKeys("n1")
    slots = {client.keyslot(k) for k in (keys.head, keys.log, keys.blocks(3), keys.checkpoint_chunk("x", 2))}
    assert len(slots) == 1  # one hash tag: the write script and transactions stay single-slot
    # A multi-key script over one namespace runs; over two namespaces it is refused.
    assert client.eval("return redis.call('MSET', KEYS[1], 1, KEYS[2], 2)", 2, keys.head, keys.epoch)
    with pytest.raises(redis.exceptions.RedisClusterException, match="same key slot"):
        client.eval("return 1", 2, keys.head, LogKeys("n2").head)
    shards = {cluster.node_of_key(LogKeys(f"ns{i}").head)[0].port for i in range(16)}
    assert len(shards) == 3  # namespaces spread over the shards
    assert client_url(client).startswith("redis+cluster://127.0.0.1:")
    client.close()

    async def roundtrip() -> bytes:
        aclient = connect_async(cluster.url)
        try:
            await aclient.set(keys.head, b"7")
            return bytes(await aclient.get(keys.head))
        finally:
            await aclient.aclose()
    assert asyncio.run(roundtrip()) == b"7"


def test_processes_refuse_a_bad_url_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from bridge.main import main as bridge_main
    from kvctl.main import main as kvctl
    from offloadd.config import ConfigError, OffloaddConfig

    with pytest.raises(ConfigError, match="redis_url: not a Redis URL"):
        OffloaddConfig(redis_url="http://127.0.0.1:1")
    assert bridge_main(["--redis-url", "redis+sentinel://127.0.0.1:1"]) == 2
    assert "names its service" in capsys.readouterr().err
    assert kvctl(["verify", "redis+cluster://127.0.0.1:x"]) != 0
    err = capsys.readouterr().err
    assert "bad host:port" in err and "Traceback" not in err
