"""What every job-control subcommand shares: its flags, the store, and a job snapshot.

Job control reads and writes the same store records the agents use (see
`elasticrun.rendezvous.records`); it never hosts a store, it only connects to one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from elasticrun.errors import UsageError
from elasticrun.launcher.flag_values import within_max_seconds
from elasticrun.launcher.flags import rdzv_conf_keys
from elasticrun.launcher.parsing import BACKENDS
from elasticrun.launcher.rdzv_conf import parse_rdzv_conf, settings_from_flags
from elasticrun.rendezvous.job_records import JobRecords
from elasticrun.rendezvous.keys import JOBS_PREFIX, Keys
from elasticrun.rendezvous.records import (
    Event,
    JobLaunch,
    JobSpec,
    LeaderState,
    NodeInfo,
    NodeStatus,
    QuarantineTable,
    StacksRequest,
    StepReport,
    StragglerReport,
)
from elasticrun.rendezvous.rounds import Round
from elasticrun.store.client.first_contact import first_contact
from elasticrun.store.interface import EventType, Store
from elasticrun.store.settings import StoreAccess, open_client, parse_access

#: the --rdzv-conf keys job control reads: how to reach the store
ACCESS_KEYS = (
    "token_file", "require_token", "tls_ca", "store_timeout", "client_cert", "client_key",
    "ca_cert", "user", "password_file", "password_env",
)


def add_job_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that name a job: the same as the launcher's, in both spellings."""
    add_store_flags(parser, with_id=True)


def add_store_flags(parser: argparse.ArgumentParser, *, with_id: bool = False) -> None:
    """The flags that name a store (and, with_id, a job on it), as the launcher spells them."""
    for name, kw in (
        ("rdzv-endpoint", dict(
            required=True,
            help="the job's store: host:port (c10d; or a list of the nodes that may serve it) or h1:2379,... (etcd)",
        )),
        ("rdzv-id", dict(required=True, help="the job's id (--rdzv-id of its agents)")),
        ("rdzv-backend", dict(default="c10d", help="c10d (default) or etcd")),
    ):
        if name == "rdzv-id" and not with_id:
            continue
        parser.add_argument(
            f"--{name}", f"--{name.replace('-', '_')}", dest=name.replace("-", "_"), **kw
        )
    parser.add_argument(
        "--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", action="append", default=[],
        help=f"store access: {rdzv_conf_keys(ACCESS_KEYS)}",
    )


@dataclass(frozen=True)
class JobTarget:
    """Which job a subcommand acts on, checked."""

    backend: str
    endpoint: str
    run_id: str
    #: the --rdzv-conf pairs as given (`elasticrun join` hands them on)
    conf: Mapping[str, str]
    access: StoreAccess

    @property
    def keys(self) -> Keys:
        return Keys(self.run_id)

    @contextlib.asynccontextmanager
    async def open(self) -> AsyncIterator[Store]:
        """A client of the job's store, once the store has answered.

        Nothing listening there, or a name that does not resolve, is an error at once,
        and a connection that takes longer than a second is said on stderr (see
        `store.client.first_contact`)."""
        async with open_client(self.access) as store:
            await first_contact(
                store,
                self.access.endpoints,
                self.access.timeout,
                self.keys.prefix if self.run_id else JOBS_PREFIX,
                patient=False,
                say=_say,
            )
            yield store


def _say(line: str) -> None:
    print(f"elasticrun: {line}", file=sys.stderr, flush=True)


def job_target(args: argparse.Namespace) -> JobTarget:
    if not args.rdzv_id or "/" in args.rdzv_id:
        raise UsageError(f"--rdzv-id must be a non-empty name without '/', got {args.rdzv_id!r}")
    return store_target(args, args.rdzv_id)


def store_target(args: argparse.Namespace, run_id: str = "") -> JobTarget:
    """The store the flags name (and the job `run_id` on it, when given)."""
    backend = BACKENDS.get(args.rdzv_backend)
    if backend not in ("c10d", "etcd"):
        raise UsageError(f"--rdzv-backend must be c10d or etcd for job control, got {args.rdzv_backend!r}")
    conf = parse_rdzv_conf(args.rdzv_conf, args.rdzv_backend)
    with settings_from_flags():
        access = parse_access(backend, args.rdzv_endpoint, conf, os.environ)
    return JobTarget(backend, args.rdzv_endpoint, run_id, conf, access)


@dataclass(frozen=True)
class JobView:
    """Everything the store holds about one job, read at one revision."""

    run_id: str
    revision: int
    round: Round | None = None
    leader: str = ""
    state: LeaderState | None = None
    spec: JobSpec | None = None
    launch: JobLaunch | None = None
    nodes: Mapping[str, NodeInfo] = field(default_factory=dict)
    statuses: Mapping[str, NodeStatus] = field(default_factory=dict)
    drains: frozenset[str] = frozenset()
    events: tuple[Event, ...] = ()
    #: the leader's failure records and quarantines (wall-clock times)
    quarantine: QuarantineTable = field(default_factory=QuarantineTable)
    #: each node's step timing, and the stragglers the leader named
    steps: Mapping[str, StepReport] = field(default_factory=dict)
    stragglers: StragglerReport | None = None
    #: the latest request for every node's stacks (done: with the summary)
    stacks: StacksRequest | None = None

    @property
    def exists(self) -> bool:
        return bool(self.round or self.spec or self.nodes)

    @property
    def running(self) -> bool:
        """A round with participants is on: a registered node outside it is a spare."""
        r = self.round
        return r is not None and bool(r.participants) and not r.closed

    @property
    def phase(self) -> str:
        """forming, running, restarting, or how the job ended."""
        r = self.round
        if r is not None and r.closed:
            return r.closed
        if r is None or not r.participants:
            return "forming"
        states = [self.statuses[p.node_id].state for p in r.participants if p.node_id in self.statuses]
        healthy = len(states) == len(r.participants) and all(s == "healthy" for s in states)
        in_round = all(self.statuses[p.node_id].round == r.number for p in r.participants if p.node_id in self.statuses)
        return "running" if healthy and in_round else "restarting"

    @property
    def min_max(self) -> tuple[int, int]:
        return (self.spec.min_nodes, self.spec.max_nodes) if self.spec else (1, 1)


async def read_job(store: Store, target: JobTarget) -> JobView:
    """The job as the store holds it now; a job that is not there is a usage error."""
    return job_view(*await read_records(store, target))


async def read_records(store: Store, target: JobTarget) -> tuple[JobRecords, int]:
    """The job's records as the store holds them now, and the revision they were read at.

    The revision is for a watch that keeps them current; a job that is not there is a
    usage error."""
    snapshot = await store.get_prefix(target.keys.prefix)
    records = JobRecords(target.keys)
    for kv in snapshot.kvs:
        records.apply(kv.key, kv.value, kv.mod_revision)
    if not job_view(records, snapshot.revision).exists:
        raise UsageError(
            f"no job '{target.run_id}' at {target.endpoint} ({target.backend}): "
            "check --rdzv-id and --rdzv-endpoint"
        )
    return records, snapshot.revision


async def read_jobs(store: Store) -> list[JobView]:
    """Every job on the store, by id, read at one revision."""
    snapshot = await store.get_prefix(JOBS_PREFIX)
    jobs: dict[str, JobRecords] = {}
    for kv in snapshot.kvs:
        run_id = kv.key[len(JOBS_PREFIX):].split("/", 1)[0]
        records = jobs.setdefault(run_id, JobRecords(Keys(run_id)))
        records.apply(kv.key, kv.value, kv.mod_revision)
    views = [job_view(records, snapshot.revision) for _, records in sorted(jobs.items())]
    return [v for v in views if v.exists]


def job_view(records: JobRecords, revision: int) -> JobView:
    return JobView(
        run_id=records.keys.run_id,
        revision=revision,
        round=records.round,
        leader=records.leader,
        state=records.state,
        spec=records.spec,
        launch=records.launch,
        nodes=records.nodes,
        statuses=records.statuses,
        drains=frozenset(records.drains),
        events=tuple(records.events.values()),
        quarantine=records.quarantine,
        steps=records.steps,
        stragglers=records.stragglers,
        stacks=records.stacks,
    )


def timeout_seconds(value: float) -> float:
    """A subcommand's `--timeout`, checked: a positive, finite number of seconds."""
    if not (value > 0 and math.isfinite(value)):
        raise UsageError(f"--timeout must be a positive number of seconds, got {value:g}")
    return within_max_seconds(value, "--timeout", f"{value:g}")


async def wait_nodes_gone(store: Store, keys: Keys, node_ids: set[str], timeout: float) -> set[str]:
    """Wait until these nodes are no longer registered; return those still there."""
    still = await wait_keys_gone(store, keys.nodes, {keys.node(n) for n in node_ids}, timeout)
    return {key[len(keys.nodes):] for key in still}


async def wait_keys_gone(store: Store, prefix: str, wanted: set[str], timeout: float) -> set[str]:
    """Wait until none of the keys `wanted` (all under `prefix`) exists.

    Return those still there after `timeout` seconds."""
    snapshot = await store.get_prefix(prefix)
    left = wanted & {kv.key for kv in snapshot.kvs}
    if not left:
        return left
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            async for event in store.watch(prefix, start_revision=snapshot.revision + 1, prefix=True):
                if event.type is EventType.DELETE:
                    left.discard(event.key)
                if not left:
                    break
    return left
