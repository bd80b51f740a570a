"""The `--rdzv-conf` keys: what each means, torchrun's names for them, and their parsing.

`parse_rdzv_conf` merges repeated `--rdzv-conf` flags (and $PET_RDZV_CONF) into one
mapping, refusing an unknown key or a bad timing in one line; `settings_from_flags`
names the flag of a store setting that cannot work.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from elasticrun.errors import StoreSettingError, UsageError
from elasticrun.launcher.flag_values import digits_only, positive_seconds
from elasticrun.launcher.spelling import closest
from elasticrun.store.wire import DEFAULT_TIMEOUT, TOKEN_ENV

#: --rdzv-conf keys that hold seconds: checked when parsed (job control reads some too)
TIMING_RDZV_CONF = (
    "join_timeout", "last_call_timeout", "heartbeat_timeout", "heartbeat_interval", "closed_ttl", "store_timeout",
    "store_host_grace", "straggler_interval",
)

#: --rdzv-conf keys that are part of the job spec: every node must use the same
SHARED_RDZV_CONF = (
    "last_call_timeout", "heartbeat_timeout", "heartbeat_interval", "closed_ttl",
    "quarantine_after", "quarantine_cooldown", "quarantine_cooldown_max",
    "straggler_relative", "straggler_after", "straggler_interval",
)

#: --rdzv-conf keys, with what they mean (shown in the error for an unknown key)
RDZV_CONF_KEYS = {
    "join_timeout": "seconds a node waits for a round before giving up (default 600)",
    "last_call_timeout": "seconds to wait for more nodes once min are there (default 1)",
    "heartbeat_timeout": "lease TTL: seconds until a silent node is dropped (default 5, or max nodes / 400 if longer)",
    "heartbeat_interval": "seconds between lease renewals (default: a third of heartbeat_timeout)",
    "closed_ttl": "seconds a finished job stays closed to late agents (default 60)",
    "quarantine_after": (
        "failures of one node (worker failures, drops out of a round) before it is kept out for a while "
        "(default 3; 0: never)"
    ),
    "quarantine_cooldown": "seconds of a node's first quarantine; each further one lasts twice as long (default 60)",
    "quarantine_cooldown_max": "the longest quarantine, in seconds; a node quiet this long is forgiven (default 3600)",
    "straggler_relative": (
        "a node is slow when its compute time per step is this many times the other nodes' median (default 1.25)"
    ),
    "straggler_after": "evaluations in a row that find a node slow before it is named a straggler (default 3)",
    "straggler_interval": "seconds between straggler evaluations, and between a node's step reports (default 5)",
    "is_host": "c10d: this agent hosts the store (true/false; default: when the endpoint is local)",
    "token_file": f"c10d: file with the store's token (default: ${TOKEN_ENV})",
    "require_token": "c10d: refuse to run without a store token (true/false; default false)",
    "tls_ca": "c10d: CA certificate (PEM) to reach the store over TLS",
    "tls_cert": "c10d: certificate (PEM) of the store this agent hosts",
    "tls_key": "c10d: private key (PEM) of the store this agent hosts",
    "client_ca": (
        "c10d: CA certificate (PEM) the store this agent hosts requires client certificates to chain to "
        "(mutual TLS; needs tls_cert, tls_key)"
    ),
    "store_timeout": f"seconds a store call may take, retries included (default {DEFAULT_TIMEOUT:g})",
    "store_host_grace": "c10d: seconds to wait for a new store when the agent hosting it is gone (default 30)",
    "ca_cert": "etcd: CA certificate (PEM)",
    "client_cert": "c10d and etcd: this client's certificate (PEM), for a store that requires one",
    "client_key": "c10d and etcd: private key (PEM) of client_cert",
    "user": "etcd: user name",
    "password_file": "etcd: file holding the password",
    "password_env": "etcd: environment variable holding the password",
}

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
    """A flag's value that came from its PET_<NAME> variable: a default the command
    line may override, where a value given twice on the command line is a mistake."""


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


def _alias_again(named: str, earlier: str, key: str, had: str | None, val: str, backend: str) -> bool:
    """`named` came as `earlier` (value `had`) and now as its other name `key` (`val`):
    whether the earlier value stays. Equal values are one; of two, torchrun's wins."""
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
