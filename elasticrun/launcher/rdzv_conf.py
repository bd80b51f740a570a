"""The `--rdzv-conf` keys: what each means, torchrun's names for them, and their parsing.

`parse_rdzv_conf` merges repeated `--rdzv-conf` flags (and $PET_RDZV_CONF) into one
mapping, refusing an unknown key or a bad timing in one line; `settings_from_flags`
names the flag of a store setting that cannot work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from elasticrun.errors import StoreSettingError, UsageError
from elasticrun.launcher.flag_values import (
    count_from_one,
    digits_only,
    positive_seconds,
    ratio_above_one,
    whole_number,
)
from elasticrun.launcher.spelling import closest
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.store.wire import DEFAULT_TIMEOUT, TOKEN_ENV

Reader = Callable[[str | None, str, Any], Any]
"""How a key's value is read and checked: (the value or None, its flag, the default) -> the value."""

#: the defaults of the rendezvous's settings: a key that sets one has its default
_SETTINGS_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RendezvousSettings)}


@dataclass(frozen=True)
class ConfKey:
    """One `--rdzv-conf` key: the one place its meaning, default, type and destination are written.

    Parsing (`parse_rdzv_conf`, `rendezvous_settings`), `--help` and the key tables of
    docs/cli.md and README.md (checked by tests/test_docs.py) all come from it.
    """

    name: str
    #: what it means, for --help (`described` adds its default)
    help: str
    #: the backends that read it ("c10d", "etcd", "c10d and etcd"; "" for the rendezvous's
    #: own, which every backend reads)
    scope: str = ""
    #: the `RendezvousSettings` field it sets, whose default is the key's; None for the
    #: store's settings, read by `elasticrun.store.settings`
    field: str | None = None
    #: how a value is read and checked (None: text, read by the store's settings)
    read: Reader | None = None
    #: the default of a key that sets no field
    default: float | bool | None = None
    #: the default in words, where the plain value does not say it all (words that begin
    #: with the plain value and a comma still have it)
    shown: str | None = None
    #: part of the job spec: every node of a job must give the same value
    shared: bool = False

    @property
    def plain_default(self) -> str | None:
        """The default as a plain value (`600`, `1.25`, `false`), or None when only words say it.

        The default column of a docs table begins with it."""
        value = _SETTINGS_DEFAULTS[self.field] if self.field is not None else self.default
        if value is None:
            return None
        text = str(value).lower() if isinstance(value, bool) else f"{value:g}"
        return text if self.shown is None or self.shown.startswith(f"{text},") else None

    def described(self) -> str:
        """The key, the backends that read it, what it means and its default: its line in --help."""
        name = f"{self.name} ({self.scope})" if self.scope else self.name
        default = self.shown or self.plain_default
        return f"{name}: {self.help}" + (f" (default {default})" if default is not None else "")


#: Every --rdzv-conf key, in the order --help and the docs list them.
RDZV_CONF: tuple[ConfKey, ...] = (
    ConfKey("join_timeout", "seconds a node waits for a round before giving up", field="join_timeout",
            read=positive_seconds),
    ConfKey("last_call_timeout", "seconds to wait for more nodes once min are there", field="last_call",
            read=positive_seconds, shared=True),
    ConfKey("heartbeat_timeout", "lease TTL: seconds until a silent node is dropped", field="heartbeat_ttl",
            read=positive_seconds, shown=f"{_SETTINGS_DEFAULTS['heartbeat_ttl']:g}, or max nodes / 400 if longer",
            shared=True),
    ConfKey("heartbeat_interval", "seconds between lease renewals", field="heartbeat_interval", read=positive_seconds,
            shown="a third of heartbeat_timeout", shared=True),
    ConfKey("closed_ttl", "seconds a finished job stays closed to late agents", field="closed_ttl",
            read=positive_seconds, shared=True),
    ConfKey("quarantine_after",
            "failures of one node (worker failures, drops out of a round) before it is kept out for a while; 0: never",
            field="quarantine_after", read=whole_number, shared=True),
    ConfKey("quarantine_cooldown", "seconds of a node's first quarantine; each further one lasts twice as long",
            field="quarantine_cooldown", read=positive_seconds, shared=True),
    ConfKey("quarantine_cooldown_max", "the longest quarantine, in seconds; a node quiet this long is forgiven",
            field="quarantine_cooldown_max", read=positive_seconds, shared=True),
    ConfKey("straggler_relative",
            "a node is slow when its compute time per step is this many times the other nodes' median",
            field="straggler_relative", read=ratio_above_one, shared=True),
    ConfKey("straggler_after", "evaluations in a row that find a node slow before it is named a straggler",
            field="straggler_after", read=count_from_one, shared=True),
    ConfKey("straggler_interval", "seconds between straggler evaluations, and between a node's step reports",
            field="straggler_interval", read=positive_seconds, shared=True),
    ConfKey("is_host", "true: this agent hosts the store from the start; false: it does not (a successor may "
            "take it over later)", "c10d",
            shown="when the endpoint is local"),
    ConfKey("token_file", "file with the store's token", "c10d", shown=f"${TOKEN_ENV}"),
    ConfKey("require_token", "true: refuse to run without a store token", "c10d", default=False),
    ConfKey("tls_ca", "CA certificate (PEM) to reach the store over TLS", "c10d"),
    ConfKey("tls_cert", "certificate (PEM) of the store this agent hosts", "c10d"),
    ConfKey("tls_key", "private key (PEM) of the store this agent hosts", "c10d"),
    ConfKey("client_ca", "CA certificate (PEM) the store this agent hosts requires client certificates to chain to "
            "(mutual TLS; needs tls_cert, tls_key)", "c10d"),
    ConfKey("store_timeout", "seconds a store call may take, retries included", read=positive_seconds,
            default=DEFAULT_TIMEOUT),
    ConfKey("store_host_grace", "seconds to wait for a new store when the agent hosting it is gone", "c10d",
            field="store_host_grace", read=positive_seconds),
    ConfKey("ca_cert", "CA certificate (PEM)", "etcd"),
    ConfKey("client_cert", "this client's certificate (PEM), for a store that requires one", "c10d and etcd"),
    ConfKey("client_key", "private key (PEM) of client_cert", "c10d and etcd"),
    ConfKey("user", "user name", "etcd"),
    ConfKey("password_file", "file holding the password", "etcd"),
    ConfKey("password_env", "environment variable holding the password", "etcd"),
)
#: the keys by name
RDZV_CONF_KEYS = {key.name: key for key in RDZV_CONF}
#: the keys that hold seconds: checked when parsed (job control reads some too)
TIMING_RDZV_CONF = tuple(key.name for key in RDZV_CONF if key.read is positive_seconds)
#: the keys that are part of the job spec: every node must use the same
SHARED_RDZV_CONF = tuple(key.name for key in RDZV_CONF if key.shared)

#: torchrun's names for keys of ours: its rendezvous timings and its etcd backends' TLS files
RDZV_CONF_ALIASES = {
    "timeout": "join_timeout",  # torchrun's etcd rendezvous: the whole join
    "read_timeout": "store_timeout",  # torchrun's c10d and etcd backends: one store call
    "keep_alive_interval": "heartbeat_interval",
    "cacert": "ca_cert",
    "cert": "client_cert",
    "key": "client_key",
    "ssl_cert": "client_cert",
    "ssl_cert_key": "client_key",
}
#: Which spelling torchrun itself reads, by --rdzv-backend, where a key of ours has an
#: alias (the others: our own). A command line may give both (PyTorch's own launcher
#: tests write `join_timeout=5,...,timeout=5`): with one value, fine; with two, the one
#: torchrun would use wins, and a warning says so.
_TORCHRUN_READS: dict[str, dict[str, str]] = {
    "join_timeout": {"etcd": "timeout"},  # torchrun's etcd (v1) rendezvous; its dynamic ones read ours
    "store_timeout": {"": "read_timeout"},
    "heartbeat_interval": {"": "keep_alive_interval"},
    "ca_cert": {"etcd": "cacert"},
    "client_cert": {"etcd": "cert", "etcd-v2": "ssl_cert"},
    "client_key": {"etcd": "key", "etcd-v2": "ssl_cert_key"},
}


def torchrun_spelling(key: str, backend: str) -> str:
    """The spelling of our `key` that torchrun reads with --rdzv-backend=`backend`."""
    reads = _TORCHRUN_READS.get(key, {})
    return reads.get(backend, reads.get("", key))


#: torchrun's key for how many missed keep-alives drop a node: with `keep_alive_interval`
#: it makes our `heartbeat_timeout` (interval x attempts, 5 s x 3 by torchrun's defaults)
KEEP_ALIVE_ATTEMPTS = "keep_alive_max_attempt"
#: torchrun's keys with no counterpart here, each for a reason (docs/cli.md says which):
#: they are accepted, so its command lines run unchanged, and warn
RDZV_CONF_TORCHRUN_ONLY = frozenset({
    "close_timeout", "store_type", "use_libuv", "protocol", "etcd_prefix", "rank",
})


class FromEnvironment(str):
    """A flag's value that came from its PET_<NAME> variable.

    A default the command line may override, where a value given twice on the command
    line is a mistake."""


def parse_rdzv_conf(values: list[str], backend: str = "c10d") -> dict[str, str]:
    """Repeated `--rdzv-conf k=v,k2=v2` flags, merged (`backend`: --rdzv-backend as given).

    A key may be given once: twice is a usage error (which of two values is meant is
    for the user to say), save that the command line overrides a key of
    $PET_RDZV_CONF (a `FromEnvironment` value), its default. A value wrapped in one pair
    of quotes (`'join_timeout=5'`, as job manifests that pass arguments without a shell
    often write it) is taken without them. torchrun's key names are taken as ours
    (`RDZV_CONF_ALIASES`, `KEEP_ALIVE_ATTEMPTS`), and count as the key they stand for;
    a key given under both its names takes torchrun's choice (`torchrun_spelling`), with
    a warning when the two values differ.
    """
    conf: dict[str, str] = {}
    #: the keys given so far: whether their value came from the environment, and the name it came by
    seen: dict[str, tuple[bool, str]] = {}
    attempts: str | None = None
    keep_alive = False  # torchrun's keep_alive_interval was given
    for value in values:
        from_env = isinstance(value, FromEnvironment)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        for item in filter(None, (p.strip() for p in value.split(","))):
            key, sep, val = item.partition("=")
            if not sep or not key:
                raise UsageError(f"--rdzv-conf takes key=value pairs, got {item!r}")
            named = RDZV_CONF_ALIASES.get(key, key)
            if named in seen and not (seen[named][0] and not from_env):
                earlier = seen[named][1]
                if earlier == key or seen[named][0] != from_env:
                    raise UsageError(
                        f"--rdzv-conf names {named} twice (the second time as {item!r}): give each key once"
                    )
                if _alias_again(named, earlier, key, conf.get(named), val, backend):
                    continue  # the first spelling is the one torchrun reads: it stays
            seen[named] = (from_env, key)
            if key in RDZV_CONF_TORCHRUN_ONLY:
                logging.getLogger("elasticrun").warning(
                    "--rdzv-conf %s is accepted for torchrun compatibility and has no effect here "
                    "(see docs/cli.md)", key
                )
                continue
            if key == KEEP_ALIVE_ATTEMPTS:
                if not (digits_only(val) and int(val) > 0):
                    raise UsageError(f"--rdzv-conf {key} must be a whole number >= 1, got {val!r}")
                attempts = val
                continue
            keep_alive = keep_alive or key == "keep_alive_interval"
            key = RDZV_CONF_ALIASES.get(key, key)
            if key not in RDZV_CONF_KEYS:
                meant = closest(key, [*RDZV_CONF_KEYS, *RDZV_CONF_ALIASES])
                if meant is not None:
                    raise UsageError(f"--rdzv-conf: unknown key {key!r}; did you mean {meant}?")
                raise UsageError(f"--rdzv-conf: unknown key {key!r} (known: {', '.join(RDZV_CONF_KEYS)})")
            if key in TIMING_RDZV_CONF:
                positive_seconds(val, f"--rdzv-conf {key}", 0.0)
            conf[key] = val
    if attempts is not None or keep_alive:
        # torchrun's keep-alive: a node is dropped after `attempts` missed intervals
        interval = float(conf.setdefault("heartbeat_interval", "5"))
        conf.setdefault("heartbeat_timeout", f"{interval * int(attempts or 3):g}")
    return conf


def rendezvous_settings(
    conf: Mapping[str, str], *, run_id: str, min_nodes: int, max_nodes: int, node_unit: int, straggler: str
) -> RendezvousSettings:
    """The rendezvous settings of a job.

    Each key of `conf` that sets one, read as its `ConfKey` says, the others at their
    defaults."""
    values: dict[str, Any] = {
        key.field: key.read(conf.get(key.name), f"--rdzv-conf {key.name}", _SETTINGS_DEFAULTS[key.field])
        for key in RDZV_CONF
        if key.field is not None and key.read is not None
    }
    if "heartbeat_timeout" not in conf:  # its default grows with the job
        values["heartbeat_ttl"] = RendezvousSettings.default_heartbeat_ttl(max_nodes)
    settings = RendezvousSettings(
        run_id=run_id, min_nodes=min_nodes, max_nodes=max_nodes, node_unit=node_unit, straggler=straggler, **values
    )
    if settings.keep_alive_interval >= settings.heartbeat_ttl:
        raise UsageError(
            f"--rdzv-conf heartbeat_interval ({settings.keep_alive_interval:g}s) must be shorter than "
            f"heartbeat_timeout ({settings.heartbeat_ttl:g}s)"
        )
    return settings


def _alias_again(named: str, earlier: str, key: str, had: str | None, val: str, backend: str) -> bool:
    """`named` came as `earlier` (value `had`) and now as its other name `key` (`val`).

    Whether the earlier value stays. Equal values are one; of two, torchrun's wins."""
    keeps = torchrun_spelling(named, backend) != key
    if had is not None and had != val:
        chosen, chosen_value = (earlier, had) if keeps else (key, val)
        logging.getLogger("elasticrun").warning(
            "--rdzv-conf gives %s twice, as %s=%s and %s=%s: taking %s=%s, as torchrun would "
            "(--rdzv-backend=%s)", named, earlier, had, key, val, chosen, chosen_value, backend,
        )
    return keeps


def rdzv_flag(setting: str) -> str:
    """The launcher flag a store setting comes from (a variable is named as it is)."""
    if setting == "endpoint":
        return "--rdzv-endpoint"
    return setting if setting.startswith("$") else f"--rdzv-conf {setting}"


@contextlib.contextmanager
def settings_from_flags(flag_of: Callable[[str], str] = rdzv_flag) -> Iterator[None]:
    """A store setting that cannot work, as the usage error that names its flag."""
    try:
        yield
    except StoreSettingError as e:
        raise UsageError(f"{', '.join(map(flag_of, e.settings))}: {e.problem}") from None
