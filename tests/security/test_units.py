"""Pieces without a process: config of the security options, token files, log masking, the
token check itself."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import grpc
import pytest

from offloadd.config import ConfigError, load_config
from rpc.auth import MISSING, WRONG, TokenCheck
from rpc.logs import JsonFormatter, redact_url, url_secrets
from rpc.tls import ClientSecurity, SecurityConfigError, read_token
from stack.healthcheck import main as healthcheck_main
from tests.security.conftest import TOKEN, write_token
from tests.security.pki import Pki


def test_config_security_fields_from_flags_and_env(tmp_path: Path, pki: Pki) -> None:
    token = write_token(tmp_path / "t", TOKEN)
    cfg = load_config(["--tls-cert-file", pki.server.cert, "--tls-key-file", pki.server.key],
                      {"KVD_AUTH_TOKEN_FILE": token, "KVD_TLS_CLIENT_CA_FILE": pki.ca.ca_file,
                       "KVD_UNIX_SOCKET_MODE": "0660"})
    assert (cfg.auth_token_file, cfg.tls_client_ca_file, cfg.unix_socket_mode, cfg.is_tls) == (
        token, pki.ca.ca_file, 0o660, True)
    default = load_config([], {})
    assert (default.unix_socket_mode, default.file_mode, default.is_tls, default.auth_token_file) == (
        0o600, 0o600, False, "")
    with pytest.raises(ConfigError, match=r"^unix_socket_mode: not a permission mode: 0o1777$"):
        load_config(["--unix-socket-mode", "1777"], {})
    with pytest.raises(ConfigError, match=r"^TLS needs both a certificate file and a key file \(got only one\)$"):
        load_config(["--tls-key-file", pki.server.key], {})


def test_read_token(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert read_token(write_token(tmp_path / "a", "  abc-DEF_123  ")) == "abc-DEF_123"
    spaced = write_token(tmp_path / "b", "two words")
    with pytest.raises(SecurityConfigError, match="the token must be one line without spaces"):
        read_token(spaced)
    group_readable = write_token(tmp_path / "c", TOKEN)
    Path(group_readable).chmod(0o640)  # group-readable is allowed (a group of engines)
    assert read_token(group_readable) == TOKEN
    assert caplog.messages == []
    Path(group_readable).chmod(0o644)
    assert read_token(group_readable) == TOKEN
    assert caplog.messages == [f"token file {group_readable} is readable by every user; chmod 600 (or 640 "
                               "with a group) it unless only trusted users can log in here"]


def test_token_check() -> None:
    check = TokenCheck(TOKEN)

    class Details(grpc.HandlerCallDetails):
        def __init__(self, method: str, metadata: tuple[tuple[str, str], ...]) -> None:
            self.method = method
            self.invocation_metadata = metadata

    method = "/kvcache.v1.OffloadStore/Stats"
    assert check.refusal(Details(method, (("authorization", f"Bearer {TOKEN}"),))) is None
    assert check.refusal(Details(method, ())) == MISSING
    assert check.refusal(Details(method, (("authorization", TOKEN),))) == WRONG  # no "Bearer "
    assert check.refusal(Details(method, (("authorization", f"bearer {TOKEN}x"),))) == WRONG
    two = (("authorization", "Bearer nope"), ("authorization", f"Bearer {TOKEN}"))
    assert check.refusal(Details(method, two)) == WRONG  # ambiguous: refused
    assert check.refusal(Details("/grpc.health.v1.Health/Check", ())) is None
    assert check.refusal(Details("/grpc.health.v1.Health/Watch", ())) is None
    assert check.refusal(Details("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", ())) == MISSING
    with pytest.raises(ValueError, match="must not be empty"):
        TokenCheck("")


def test_log_lines_mask_secrets() -> None:
    url = "redis://kvd:p%40ss-word-9@10.0.0.1:6379/0"
    assert set(url_secrets(url)) == {"p%40ss-word-9", "p@ss-word-9"}
    assert url_secrets("redis://10.0.0.1:6379/0") == ()
    fmt = JsonFormatter(secrets=(TOKEN, *url_secrets(url), "ab"))
    record = logging.makeLogRecord({"msg": "connect %s with %s failed: p@ss-word-9 ab",
                                    "args": (url, TOKEN), "levelname": "ERROR", "name": "x"})
    line = json.loads(fmt.format(record))
    assert line["msg"] == "connect redis://kvd:***@10.0.0.1:6379/0 with *** failed: *** ab"
    assert redact_url("not a url") == "not a url"
    assert redact_url("redis://[::1") == "***"  # unparseable: may be all secret


def test_client_security_repr_and_bad_files(tmp_path: Path, pki: Pki) -> None:
    sec = ClientSecurity(None, TOKEN)
    assert repr(sec) == "ClientSecurity(tls=False, token=***)"
    assert TOKEN not in str(sec)
    with pytest.raises(SecurityConfigError, match=r"needs both --\*-cert and --\*-key"):
        ClientSecurity.from_files(pki.ca.ca_file, cert_file=pki.client.cert)
    empty = tmp_path / "empty.pem"
    empty.write_text("\n")
    with pytest.raises(SecurityConfigError, match=f"^CA certificate {str(empty)!r} is empty$"):
        ClientSecurity.from_files(str(empty))


def test_healthcheck_cli_usage_errors(capsys: pytest.CaptureFixture[str], pki: Pki) -> None:
    assert healthcheck_main(["grpc"]) == 2
    assert "the following arguments are required: target" in capsys.readouterr().err
    assert healthcheck_main(["grpc", "127.0.0.1:1", "--ca", "/nonexistent.pem"]) == 2
    assert "CA certificate '/nonexistent.pem': No such file or directory" in capsys.readouterr().err
    assert healthcheck_main(["grpc", "127.0.0.1:1", "--ca", pki.ca.ca_file]) == 1
    assert capsys.readouterr().err.strip() == "127.0.0.1:1: UNAVAILABLE"
