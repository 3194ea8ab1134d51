"""Redis AUTH and ACL through the URL (offloadd and kv-bridge), secrets kept out of the logs,
and the arena files' modes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from events.logkeys import LogKeys
from events.schema import BlockStored
from offloadd.client import BlockToStore, GroupSpec, OffloadClient, ReserveStatus
from rpc.logs import redact_url
from tests.security.conftest import TOKEN, other_group, start_daemon
from tests.support.bridge_proc import BridgeProcess, LogWriter
from tests.support.offloadd_proc import REPO
from tests.support.redis_proc import RedisProcess

PASSWORD = "r3dis-Pa55word-" + "q" * 12
ACL_PASSWORD = "acl-Pa55word-" + "z" * 12
SLOT = 256
GROUP = GroupSpec(0, "full_attention", 0, 4, SLOT, "uint8", "sec-layout")
# The ACL SECURITY.md recommends for the daemon and the bridge: their own keys only, no admin
# or dangerous commands (FLUSHALL, KEYS, CONFIG, ...).
DAEMON_ACL = ("on", f">{ACL_PASSWORD}", "~kvd:*", "resetchannels", "+@all", "-@dangerous")


@pytest.fixture(scope="module")
def auth_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path_factory.mktemp("redis-auth"), password=PASSWORD)
    server.start()
    admin = redis.Redis.from_url(server.url)
    admin.acl_setuser("kvd", reset=True, enabled=True, passwords=[f"+{ACL_PASSWORD}"], keys=["kvd:*"],
                      commands=["+@all", "-@dangerous"], channels=[])
    # The bridge only reads the log and writes its own position (SECURITY.md).
    admin.execute_command("ACL", "SETUSER", "kvbridge", "reset", "on", f">{ACL_PASSWORD}",
                          "%R~kvd:*", "~kvd:*:bridge:*", "resetchannels", "+@all", "-@dangerous")
    admin.close()
    yield server
    server.stop()


def _store_one_block(target: str, token: str | None = None) -> None:
    """Register, reserve, write, commit: every kind of Redis write the daemon does on a store."""
    with OffloadClient(target, token=token) as c:
        reg = c.register_engine("e", 1, "m", [GROUP])
        arena = reg.map_arena(0)
        out = c.reserve("e", 0, [BlockToStore(b"h" * 32, None, (1, 2, 3, 4))])
        ((status, slot),) = out.blocks
        assert status == ReserveStatus.RESERVED
        arena.write(slot, b"\x07" * SLOT)
        assert c.commit("e", out.reservation_id).num_committed == 1
        arena.close()
        assert c.stats().num_blocks == 1


def _acl_url(server: RedisProcess) -> str:
    return f"redis://kvd:{ACL_PASSWORD}@127.0.0.1:{server.port}/0"


def test_daemon_with_password_url_and_no_secret_in_logs(tmp_path: Path, auth_redis: RedisProcess) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    d = start_daemon(tmp_path / "d", auth_redis.url, "pw", "--auth-token-file", str(token_file),
                     "--log-level", "DEBUG")
    try:
        _store_one_block(d.target, TOKEN)
    finally:
        assert d.stop() == 0
    text = d.log_path.read_text()
    assert '"msg": "serving"' in text
    assert '"msg": "bearer token over plaintext TCP on 127.0.0.1: anyone who can see the traffic' in text
    assert PASSWORD not in text and TOKEN not in text


def test_daemon_with_acl_user(tmp_path: Path, auth_redis: RedisProcess) -> None:
    d = start_daemon(tmp_path / "d", _acl_url(auth_redis), "acl")
    try:
        _store_one_block(d.target)
    finally:
        assert d.stop() == 0
    assert ACL_PASSWORD not in d.log_path.read_text()


def _offloadd(tmp_path: Path, redis_url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVD_REDIS_URL": redis_url}
    args = [sys.executable, "-m", "offloadd", "--grpc-host=127.0.0.1", "--grpc-port=0",
            "--metrics-port=-1", f"--arena-dir={tmp_path / 'arena'}", "--capacity-bytes=65536",
            "--redis-timeout-s=1"]
    return subprocess.run(args, capture_output=True, text=True, timeout=30, env=env, cwd=REPO)


def test_daemon_refuses_to_start_without_the_password(tmp_path: Path, auth_redis: RedisProcess) -> None:
    port = auth_redis.port
    advice = "put the password, and the ACL user if any, in the Redis URL: redis://USER:PASSWORD@HOST:PORT/DB"
    cases = {
        f"redis://127.0.0.1:{port}/0": "Redis refused to authenticate user 'default' (HELLO must be called",
        f"redis://:wrong-{PASSWORD}@127.0.0.1:{port}/0":
            "Redis refused to authenticate user 'default' (invalid username-password pair or user is disabled.)",
        f"redis://kvd:wrong-{ACL_PASSWORD}@127.0.0.1:{port}/0":
            "Redis refused to authenticate user 'kvd' (invalid username-password pair or user is disabled.)",
    }
    for url, why in cases.items():
        out = _offloadd(tmp_path, url)
        assert out.returncode == 1, out.stderr
        assert f'"msg": "cannot start: {why}' in out.stderr, out.stderr
        assert f"{advice} (now {redact_url(url)})" in out.stderr
        assert "Traceback" not in out.stderr
        assert PASSWORD not in out.stderr and ACL_PASSWORD not in out.stderr
    # The bridge's read-only user cannot run the daemon: said so, with what it needs.
    out = _offloadd(tmp_path, _acl_url(auth_redis).replace("//kvd:", "//kvbridge:"))
    assert out.returncode == 1
    assert ('"msg": "cannot start: the Redis ACL user lacks a permission (this user has no permissions to '
            "access one of the keys used as arguments); it needs the keys 'kvd:*' and the commands of "
            '+@all -@dangerous (SECURITY.md)"') in out.stderr, out.stderr


def test_bridge_with_password_and_acl_urls(tmp_path: Path, auth_redis: RedisProcess) -> None:
    bridge_url = _acl_url(auth_redis).replace("//kvd:", "//kvbridge:")
    admin = redis.Redis.from_url(auth_redis.url)
    for name, url, secret in (("pw", auth_redis.url, PASSWORD), ("acl", bridge_url, ACL_PASSWORD)):
        namespace = "bridge" + name
        writer = LogWriter(admin, namespace)
        writer.append("engine-a", [BlockStored((1, 2), None, tuple(range(8)), 4, "GPU")])
        bridge = BridgeProcess(url, tmp_path / name, "--log-level", "DEBUG", "--start", "beginning",
                               namespace=namespace)
        bridge.start()
        try:
            assert bridge.health()[0] == 200
        finally:
            assert bridge.stop() == 0
        # It read the log and saved its position: the ACL gave it what it needs.
        assert admin.hget(LogKeys(namespace).bridge("kv-bridge"), "offset") == b"1", bridge.output()
        assert secret not in bridge.output() and "permission" not in bridge.output()
    admin.close()
    # Without the password the bridge keeps retrying and says why, without the secret.
    bridge = BridgeProcess(f"redis://127.0.0.1:{auth_redis.port}/0", tmp_path / "nopw", namespace="bridgenopw")
    bridge.start(wait_healthy=False)
    try:
        import time

        deadline = time.monotonic() + 10
        while "Authentication required" not in bridge.output() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        bridge.stop()
    assert "Authentication required" in bridge.output()


def test_redact_url_hides_only_the_password() -> None:
    assert redact_url(auth_url := f"redis://kvd:{ACL_PASSWORD}@127.0.0.1:6379/0") == "redis://kvd:***@127.0.0.1:6379/0"
    assert ACL_PASSWORD not in redact_url(auth_url)
    assert redact_url(f"redis://:{PASSWORD}@h:1/2") == "redis://:***@h:1/2"
    assert redact_url("rediss://h:6380/0") == "rediss://h:6380/0"


def _arena_files(arena_dir: Path) -> list[Path]:
    return sorted(p for p in arena_dir.iterdir() if p.is_file())


@pytest.mark.parametrize("with_group", [False, True])
def test_arena_file_modes(tmp_path: Path, redis_url: str, with_group: bool) -> None:
    group, gid = other_group() if with_group else ("", os.getgid())
    args = ("--file-mode", "660", "--file-group", group) if with_group else ()
    d = start_daemon(tmp_path / "d", redis_url, "modes", *args)
    try:
        _store_one_block(d.target)
        mode = 0o660 if with_group else 0o600
        files = _arena_files(d.arena_dir)
        # The chunk and the slot generation table (engines map both) get the configured mode.
        shared = [f for f in files if not f.name.endswith(".arena-id")]
        assert sorted(f.name for f in shared) == ["kvd-modes-L1-C0", "kvd-modes-L1-Cgen"]
        for f in shared:
            st = f.stat()
            assert (stat.S_IMODE(st.st_mode), st.st_gid) == (mode, gid)
        # The arena-id marker holds no KV bytes; it is created under the umask, never wider.
        (marker,) = [f for f in files if f.name.endswith(".arena-id")]
        assert stat.S_IMODE(marker.stat().st_mode) & ~mode == 0
    finally:
        d.stop()
