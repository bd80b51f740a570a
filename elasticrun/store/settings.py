"""How a launcher reaches its job's store: one record, read once from the store settings.

`--rdzv-conf` carries the store's settings for both backends next to the rendezvous
timings: the built-in store's token and TLS files (its key pair, the CA its clients'
certificates must chain to), etcd's TLS files and credentials, this client's certificate
(both backends), the call timeout. `parse_access` reads them once, files and secrets included, so that a
missing certificate fails before anything starts and the store classes take plain
values; `open_client` and `serve_here` are the one place a store is opened from them.
It also knows which environment variables hold the store's secrets (`StoreAccess.secret_env`),
so that the launcher can keep them from the workers, and when a store served without a
token or client certificates is open to others (`exposure_warning`).

Errors are `StoreSettingError`s naming the setting; the command that took the setting
from the user turns them into usage messages naming its flag.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import math
import re
import socket
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from elasticrun.errors import NotAStoreError, StoreAddressError, StoreSettingError, StoreUnavailableError
from elasticrun.loglines import HEADLINE
from elasticrun.store.client.first_contact import first_contact
from elasticrun.store.interface import MAX_LEASE_TTL, Store
from elasticrun.store.wire import (
    CLIENT_CA_NEEDS_TLS,
    DEFAULT_C10D_PORT,
    DEFAULT_ETCD_PORT,
    DEFAULT_TIMEOUT,
    TOKEN_ENV,
    TlsKeyPair,
    is_loopback,
)

if TYPE_CHECKING:
    from elasticrun.store.server.memory import MemoryStore
    from elasticrun.store.server.metrics import StoreMetrics
    from elasticrun.store.server.store_server import StoreServer

log = logging.getLogger("elasticrun")

#: Where each backend listens when an endpoint names no port.
DEFAULT_PORTS = {"c10d": DEFAULT_C10D_PORT, "etcd": DEFAULT_ETCD_PORT}

#: The variables that hold a store secret whatever the settings: kept from the workers.
SECRET_ENV = frozenset({TOKEN_ENV})


@dataclass(frozen=True)
class StoreAccess:
    """Everything needed to open the job's store, checked and read.

    `tls_ca` is the CA a client trusts (etcd: `ca_cert`) and `client_tls` the client's
    own certificate (`client_cert`/`client_key`), for a server that requires one (etcd's
    --client-cert-auth, the built-in store's `client_ca`). For c10d, `server_tls` is the
    key pair of the store an agent hosts and `client_ca` the CA that store requires its
    clients' certificates to chain to.
    """

    backend: str  # "c10d" or "etcd"
    #: host:port each (IPv6 in brackets). c10d: the first is where an agent serves the
    #: store at the start; the others are nodes that may serve it later (successors)
    endpoints: tuple[str, ...]
    timeout: float = DEFAULT_TIMEOUT
    token: str | None = field(default=None, repr=False)
    tls_ca: bytes | None = None
    client_tls: TlsKeyPair | None = field(default=None, repr=False)
    server_tls: TlsKeyPair | None = field(default=None, repr=False)
    client_ca: bytes | None = None
    #: c10d: True hosts the store or fails, False never hosts it, None hosts it when the
    #: endpoint is this host's and free (as torchrun does)
    is_host: bool | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    #: the environment variables that hold this store's secrets (the token's, etcd's
    #: password_env): the agent keeps them from its workers
    secret_env: frozenset[str] = SECRET_ENV

    @property
    def endpoint(self) -> str:
        return ",".join(self.endpoints)


def parse_endpoints(spec: str, default_port: int) -> tuple[str, ...]:
    """Split an endpoint list ("h1:2379,h2,[::1]:2379") into host:port strings."""
    endpoints = []
    for item in (part.strip() for part in spec.split(",")):
        if "://" in item:
            raise StoreSettingError(
                "endpoint", f"{spec!r}: give host:port without a scheme; TLS is set by its own settings"
            )
        try:
            parts = urllib.parse.urlsplit("//" + item)
            host, port = parts.hostname or "", parts.port
            port = default_port if port is None else port
            extra = bool(parts.path or parts.query or parts.fragment or parts.username)
        except ValueError:  # a port that is no number in 0..65535
            host, extra = "", True
        if extra or port == 0 or not _is_host(host):
            raise StoreSettingError(
                "endpoint", f"malformed store endpoint {item!r}: expected host[:port], e.g. node0:{default_port}"
            )
        endpoints.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return tuple(endpoints)


#: a host name as the resolver takes it: dot-separated labels of letters, digits, '-' and
#: '_' (which internal names use), a label neither starting nor ending with '-'
_HOST_NAME = re.compile(r"(?!-)[\w-]+(?<!-)(\.(?!-)[\w-]+(?<!-))*\.?", re.ASCII)


def _is_host(host: str) -> bool:
    """An IP address (v6 without its brackets) or a host name, IDNA names included."""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return False
        return True
    try:
        ascii_name = host.encode("idna").decode()
    except UnicodeError:  # an empty or over-long label, an undecodable byte
        return False
    return _HOST_NAME.fullmatch(ascii_name) is not None


def read_token(token_file: str | None, environ: Mapping[str, str], *, required: bool = False) -> str | None:
    """The built-in store's token: the file's content (stripped), else $ELASTICRUN_STORE_TOKEN.

    It travels as a gRPC header value, which must be printable ASCII: anything else is
    refused here, with the place it came from, rather than failing every call later.
    `required` (the require_token setting) makes a missing token an error: a site that
    wants every store protected says so once, and a launch that lost its token on the
    way fails at once instead of running open to anyone who reaches the port.
    """
    if token_file is None:
        token, setting = environ.get(TOKEN_ENV) or None, f"${TOKEN_ENV}"
    else:
        token, setting = read_file("token_file", token_file).decode("latin-1").strip(), "token_file"
        if not token:
            raise StoreSettingError(setting, f"{token_file} is empty")
    if token is not None and not all(" " <= c <= "~" for c in token):
        raise StoreSettingError(setting, "the token must be printable ASCII text (it is sent as a gRPC header)")
    if token is None and required:
        raise StoreSettingError(
            ("require_token", "token_file"), f"no store token is set: give a token file, or set ${TOKEN_ENV}"
        )
    return token


#: The largest file a setting may name: a certificate chain, a key, a token or a
#: password is a few KiB; anything larger is the wrong file (or /dev/zero), read no further.
MAX_SETTING_FILE_BYTES = 1 << 20


def read_file(setting: str, path: str) -> bytes:
    """The file a setting names (a certificate, a key, a token, a password).

    At most `MAX_SETTING_FILE_BYTES` are read (one byte more, to tell that it is
    larger): a setting naming a device or a huge file fails in one line instead of
    filling the memory.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SETTING_FILE_BYTES + 1)
    except OSError as e:
        raise StoreSettingError(setting, f"cannot read {path}: {e.strerror}") from None
    if len(data) > MAX_SETTING_FILE_BYTES:
        raise StoreSettingError(
            setting,
            f"{path} is larger than {MAX_SETTING_FILE_BYTES >> 20} MiB: name the file itself (PEM, token, password)",
        )
    return data


def key_pair(settings: Mapping[str, str], cert: str, key: str) -> TlsKeyPair | None:
    """The certificate and key that two settings name: both or neither."""
    if (cert in settings) != (key in settings):
        raise StoreSettingError((cert, key), "give both or neither")
    if cert not in settings:
        return None
    return TlsKeyPair(cert=read_file(cert, settings[cert]), key=read_file(key, settings[key]))


def server_tls(settings: Mapping[str, str]) -> tuple[TlsKeyPair | None, bytes | None]:
    """The built-in store's own key pair and the CA its clients' certificates must chain to.

    The pair is `tls_cert` and `tls_key`; the CA, `client_ca`, needs the pair."""
    pair = key_pair(settings, "tls_cert", "tls_key")
    client_ca = settings.get("client_ca")
    if client_ca is None:
        return pair, None
    if pair is None:
        raise StoreSettingError(("client_ca", "tls_cert", "tls_key"), CLIENT_CA_NEEDS_TLS)
    return pair, read_file("client_ca", client_ca)


def parse_access(
    backend: str, endpoint: str, settings: Mapping[str, str], environ: Mapping[str, str]
) -> StoreAccess:
    """Read the settings of `backend` ("c10d" or "etcd") once; unrelated keys are ignored."""
    endpoints = parse_endpoints(endpoint, DEFAULT_PORTS[backend])
    timeout = _seconds(settings.get("store_timeout"))
    # a variable named as holding a password is a secret, whichever backend reads it
    password_env = settings.get("password_env")
    secret_env = SECRET_ENV | ({password_env} if password_env else set())
    if backend == "etcd":
        user, password = _etcd_credentials(settings, environ)
        ca = settings.get("ca_cert")
        return StoreAccess(
            backend,
            endpoints,
            timeout,
            tls_ca=read_file("ca_cert", ca) if ca else None,
            client_tls=key_pair(settings, "client_cert", "client_key"),
            user=user,
            password=password,
            secret_env=secret_env,
        )
    ca = settings.get("tls_ca")
    pair, client_ca = server_tls(settings)
    return StoreAccess(
        backend,
        endpoints,
        timeout,
        token=read_token(settings.get("token_file"), environ, required=bool(_boolean("require_token", settings))),
        tls_ca=read_file("tls_ca", ca) if ca else None,
        client_tls=key_pair(settings, "client_cert", "client_key"),
        server_tls=pair,
        client_ca=client_ca,
        is_host=_boolean("is_host", settings),
        secret_env=secret_env,
    )


def _seconds(value: str | None) -> float:
    if value is None:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (0 < seconds <= MAX_LEASE_TTL):
        raise StoreSettingError(
            "store_timeout", f"must be a positive number of seconds up to {MAX_LEASE_TTL:.0f}, got {value!r}"
        )
    return seconds


def _boolean(setting: str, settings: Mapping[str, str]) -> bool | None:
    """A true/false setting (1/0 too); None when it is not given or empty."""
    value = settings.get(setting)
    if value is None or value == "":
        return None
    answer = {"true": True, "1": True, "false": False, "0": False}.get(value.lower())
    if answer is None:
        raise StoreSettingError(setting, f"must be true or false, got {value!r}")
    return answer


def _etcd_credentials(settings: Mapping[str, str], environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """etcd's user and password; the password comes from a file or the environment only."""
    if "password" in settings:
        raise StoreSettingError(
            "password",
            "it would put the etcd password on the command line: use password_file=<path> or "
            "password_env=<VARIABLE> instead",
        )
    user = settings.get("user")
    password_file, password_env = settings.get("password_file"), settings.get("password_env")
    if password_file is not None and password_env is not None:
        raise StoreSettingError(("password_file", "password_env"), "give one of them, not both")
    password = None
    if password_file is not None:
        try:
            password = read_file("password_file", password_file).decode().rstrip("\r\n")
        except UnicodeDecodeError:
            raise StoreSettingError("password_file", f"{password_file}: the file is not UTF-8 text") from None
    elif password_env is not None:
        password = environ.get(password_env)
        if password is None:
            raise StoreSettingError("password_env", f"{password_env}: that environment variable is not set")
        try:
            password.encode()
        except UnicodeEncodeError:
            raise StoreSettingError("password_env", f"{password_env}: the value is not UTF-8 text") from None
    if (user is None) != (password is None):
        raise StoreSettingError(
            ("user", "password_file", "password_env"),
            "etcd auth needs user together with password_file or password_env",
        )
    return user, password


def open_client(access: StoreAccess) -> Store:
    """A client of the job's store: the built-in gRPC store, or etcd.

    A secret about to travel in plaintext to another host is warned about here, once
    per process and store (`plaintext_warning`): this is the one place every command
    opens a store from its settings.
    """
    warning = plaintext_warning(access)
    if warning is not None and access.endpoint not in _WARNED_PLAINTEXT:
        _WARNED_PLAINTEXT.add(access.endpoint)
        log.warning("%s", warning)
    if access.backend == "etcd":
        from elasticrun.store.etcd.backend import EtcdStore

        return EtcdStore(
            access.endpoints,
            tls_ca=access.tls_ca,
            client_tls=access.client_tls,
            user=access.user,
            password=access.password,
            timeout=access.timeout,
        )
    from elasticrun.store.client.grpc_store import GrpcStore

    return GrpcStore(
        access.endpoints[0],
        others=access.endpoints[1:],
        token=access.token,
        tls_ca=access.tls_ca,
        client_tls=access.client_tls,
        timeout=access.timeout,
    )


#: the stores whose plaintext secret this process has warned about
_WARNED_PLAINTEXT: set[str] = set()


def plaintext_warning(access: StoreAccess) -> str | None:
    """What to tell a client that sends a secret without TLS to an address other hosts can see.

    The secret is the built-in store's token or etcd's password; None otherwise.

    Anyone on the network path then reads the secret and may use the store as this
    client does; the line names the setting that turns TLS on.
    """
    if access.tls_ca is not None or all(is_loopback(ep.rpartition(":")[0]) for ep in access.endpoints):
        return None
    if access.backend == "c10d" and access.token is not None:
        return (
            f"the store token goes to {access.endpoint} in plaintext: anyone on the network path can read it "
            "and use the store; serve the store with TLS and set --rdzv-conf tls_ca=<its CA certificate>"
        )
    if access.backend == "etcd" and access.password is not None:
        return (
            f"the etcd password of user '{access.user}' goes to {access.endpoint} in plaintext: anyone on the "
            "network path can read it; serve etcd with TLS and set --rdzv-conf ca_cert=<its CA certificate>"
        )
    return None


def exposure_warning(
    endpoint: str,
    token: str | None,
    token_flag: str,
    *,
    client_ca: bytes | None = None,
    tls: bool = False,
    tls_flags: str = "--tls-cert and --tls-key",
) -> str | None:
    """What to tell whoever serves the store on `endpoint` where others can reach it.

    Without a token (None when a token or a CA for client certificates is set), or with
    a token but without TLS; None on loopback only.

    Without either the store cannot tell a node of the job from anyone else on the
    network, so the line says who can do what, and how to close it (`token_flag` is
    the token's flag in the command at hand). With a token but no TLS, every client
    sends it in plaintext, and whoever reads it off the network holds the admin role.
    """
    if is_loopback(endpoint.rpartition(":")[0]):
        return None
    if token is not None and not tls:
        return (
            f"the store on {endpoint} takes its token in plaintext: anyone on the network path can read it "
            f"and use the store as an agent; serve TLS ({tls_flags}) and give every client tls_ca"
        )
    if token is not None or client_ca is not None:
        return None
    return (
        f"the store on {endpoint} has no token: anyone who can reach that port can join the job, "
        f"read and change its records, and stop it; set {token_flag} or ${TOKEN_ENV} on every node "
        "and for job control"
    )


async def serve_here(access: StoreAccess, probe_key: str, metrics: StoreMetrics | None = None) -> StoreServer | None:
    """Serve the built-in store on its endpoint, started, when this agent is to host it.

    Without `is_host` that is when the endpoint is this host's and its port is free; with
    `is_host=true` a port that cannot be had is an error, with `is_host=false` nothing is
    tried. An endpoint of this host whose port is taken must be a store (another agent of
    the job on this host hosts it, or `store serve` does): a read of `probe_key` shows
    it, and anything else there is an error (StoreAddressError), not a store to wait
    for. The caller stops the server.
    """
    if access.backend != "c10d" or access.is_host is False:
        return None
    if access.is_host is None and await _served_elsewhere(access):
        return None
    endpoint = access.endpoints[0]
    host = endpoint.rpartition(":")[0]
    server = hosted_server(access, endpoint, metrics=metrics)
    try:
        await server.start()
    except StoreAddressError:
        if access.is_host:
            raise
        if not await _is_own_address(host.strip("[]")):
            log.debug("not hosting the store: %s is another host's", access.endpoint)
            return None
        await _check_holder(replace(access, endpoints=(endpoint,)), probe_key)
        log.debug("not hosting the store: another store on this host serves %s", access.endpoint)
        return None
    return server


async def _served_elsewhere(access: StoreAccess) -> bool:
    """Whether an agent at another endpoint of the list serves the store now (a successor took it over).

    An agent restarted at the first endpoint then joins the job there instead of
    hosting a new, empty store."""
    others = access.endpoints[1:]
    if not others:
        return False
    store = open_client(replace(access, endpoints=others))
    try:
        serving = await store.turn_to(others)
    finally:
        await store.close()
    if serving:
        log.debug("not hosting the store: an agent serves it at %s", serving)
    return bool(serving)


def hosted_server(
    access: StoreAccess, endpoint: str, *, engine: MemoryStore | None = None, metrics: StoreMetrics | None = None
) -> StoreServer:
    """The built-in store as an agent serves it at `endpoint`, with the job's token and TLS (not started).

    `engine`: the records to serve (a successor's copy, docs/concepts.md); a new empty
    store without it."""
    from elasticrun.store.server.store_server import StoreServer

    host, _, port = endpoint.rpartition(":")
    return StoreServer(
        host.strip("[]"),
        int(port),
        engine=engine,
        token=access.token,
        tls=access.server_tls,
        client_ca=access.client_ca,
        hosted_by_agent=True,
        metrics=metrics,
    )


async def _is_own_address(host: str) -> bool:
    """Whether `host` names an address of this host (one a socket can be bound to)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:
                    continue
            return True
    return False


async def _check_holder(access: StoreAccess, probe_key: str) -> None:
    """Raise StoreAddressError unless a store answers on the taken port of this host."""
    store = open_client(access)
    try:
        await first_contact(
            store, access.endpoints, access.timeout, probe_key, patient=True,
            say=lambda line: log.info("%s", line, extra=HEADLINE),  # a wait the user should see
        )
    except (NotAStoreError, StoreUnavailableError) as e:
        what = e.what if isinstance(e, NotAStoreError) else f"it did not answer as a store within {access.timeout:g} s"
        raise StoreAddressError(
            f"the store's port {access.endpoint} on this host is taken by another program ({what}): stop it, "
            "or give the job another port in --rdzv-endpoint"
        ) from None
    finally:
        await store.close()
