"""The store's settings as bad input meets them: the files they name are read
up to a bound, and a secret about to travel in plaintext to another host is warned of.

No traffic leaves this host: the non-loopback address is one of RFC 5737's documentation
addresses (192.0.2.0/24), and a client is only made, never called (its channel opens on
its first call).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from elasticrun.errors import StoreSettingError
from elasticrun.store.settings import MAX_SETTING_FILE_BYTES, open_client, parse_access, plaintext_warning, read_file

REMOTE = "192.0.2.7:29400"


def test_a_file_a_setting_names_is_read_up_to_1_mib(tmp_path: Path) -> None:
    at_bound = tmp_path / "ca.pem"
    at_bound.write_bytes(b"x" * MAX_SETTING_FILE_BYTES)
    assert len(read_file("tls_ca", str(at_bound))) == MAX_SETTING_FILE_BYTES
    over = tmp_path / "big.pem"
    over.write_bytes(b"x" * (MAX_SETTING_FILE_BYTES + 1))
    for path in (over, Path("/dev/zero")):  # a device that never ends: one line, not a MemoryError
        with pytest.raises(StoreSettingError, match=r"is larger than 1 MiB") as e:
            read_file("token_file", str(path))
        assert e.value.settings == ("token_file",)


@pytest.fixture
def token(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text("s3cret")
    return str(path)


def test_a_token_or_password_in_plaintext_to_another_host_is_warned_of(tmp_path: Path, token: str) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("PEM")
    plain = plaintext_warning(parse_access("c10d", REMOTE, {"token_file": token}, {}))
    assert plain is not None and REMOTE in plain and "--rdzv-conf tls_ca=" in plain
    assert "s3cret" not in plain
    etcd = plaintext_warning(
        parse_access("etcd", f"{REMOTE},192.0.2.8", {"user": "u", "password_env": "P"}, {"P": "pw"})
    )
    assert etcd is not None and "user 'u'" in etcd and "--rdzv-conf ca_cert=" in etcd and "pw" not in etcd
    for quiet in (
        parse_access("c10d", REMOTE, {"token_file": token, "tls_ca": str(ca)}, {}),  # TLS
        parse_access("c10d", "127.0.0.1:29400", {"token_file": token}, {}),  # loopback: stays on this host
        parse_access("c10d", REMOTE, {}, {}),  # no secret to leak (store serve warns of the open store)
        parse_access("etcd", REMOTE, {"user": "u", "password_env": "P", "ca_cert": str(ca)}, {"P": "pw"}),
    ):
        assert plaintext_warning(quiet) is None


async def test_the_warning_comes_once_per_store(token: str, caplog: pytest.LogCaptureFixture) -> None:
    access = parse_access("c10d", "192.0.2.9:29400", {"token_file": token}, {})
    with caplog.at_level(logging.WARNING, logger="elasticrun"):
        for _ in range(3):
            await open_client(access).close()
    assert [r.getMessage() for r in caplog.records].count(plaintext_warning(access)) == 1
