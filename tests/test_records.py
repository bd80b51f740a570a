"""The record codec: every record survives the store as JSON, and each key of a job
becomes its record in one place (`JobRecords`), whoever reads it."""

from __future__ import annotations

import json

import pytest

from elasticrun.errors import RendezvousError
from elasticrun.rendezvous.state import (
    FORMAT_VERSION,
    DrainRequest,
    Event,
    JobLaunch,
    JobRecords,
    JobSpec,
    Keys,
    LeaderState,
    LogLine,
    LogWindow,
    Master,
    NodeInfo,
    NodeStatus,
    Participant,
    Ping,
    QuarantineEntry,
    QuarantineTable,
    Record,
    RestartRequest,
    Round,
    decode,
    encode,
)

KEYS = Keys("job")
NODE = NodeInfo("a", "host", "10.0.0.1", 2, 7, 1.5, gpus=("H100", "H100"), ran_round=3, ran_restarts=1)
ROUND = Round(4, (Participant("a", "10.0.0.1", 2), Participant("b", "10.0.0.2", 1)), 1, "node b joined", 9.5)
SPEC = JobSpec(command=("-m", "train", "--lr", "1"), nproc_per_node="gpu", min_nodes=1, max_nodes=4,
               progress_timeout=30.0, rdzv_conf={"closed_ttl": "5"})
QUARANTINE = QuarantineTable(entries=(QuarantineEntry("b", failures=2, times=1, until=99.0, reason="why"),),
                             counted_round=3)
STATUS = NodeStatus("a", "host", "10.0.0.1", "healthy", "", 4, 0, "0-1", 3, 1, 2, (11, 12), ("H100",), 1.0, 2.0)

#: one record of each kind, at a key that holds that kind
SAMPLES: list[tuple[str, Record]] = [
    (KEYS.node("a"), NODE),
    (KEYS.restart, RestartRequest(4, "a", "exit 1", final=True, report="Traceback")),
    (KEYS.ack("a"), Ping(4)),
    (KEYS.round, ROUND),
    (KEYS.master, Master(4, "10.0.0.1", 29500)),
    (KEYS.ping, Ping(4)),
    (KEYS.spec, SPEC),
    (KEYS.state, LeaderState("a", "waiting", 2, 3.0, waiting=("c",))),
    (KEYS.launch, JobLaunch("/work", 1.0, "a")),
    (KEYS.drain("a"), DrainRequest("scale in", 2.0)),
    (KEYS.quarantine, QUARANTINE),
    (KEYS.status("a"), STATUS),
    (KEYS.event(2.0, "a"), Event(2.0, "a", "round", "round 4")),
]


@pytest.mark.parametrize("record", [r for _, r in SAMPLES] + [LogWindow(3, "a", (LogLine(1, "stdout", "hi"),))])
def test_every_record_survives_the_store_with_its_nested_records_and_tuples(record: Record) -> None:
    assert decode(type(record), encode(record)) == record


def test_each_key_becomes_its_record_and_a_deleted_key_forgets_it() -> None:
    records = JobRecords(KEYS)
    for key, record in SAMPLES:
        records.apply(key, encode(record), revision=7)
    records.apply(KEYS.leader, b"a")
    assert (records.nodes, records.acks, records.statuses) == ({"a": NODE}, {"a": Ping(4)}, {"a": STATUS})
    assert (records.round, records.round_revision, records.spec, records.leader) == (ROUND, 7, SPEC, "a")
    assert records.quarantine == QUARANTINE and list(records.drains) == ["a"] and len(records.events) == 1
    for key, _ in SAMPLES:
        records.apply(key, None)
    records.apply(KEYS.leader, None)
    assert records == JobRecords(KEYS)


def test_keys_of_other_jobs_and_output_windows_are_not_kept() -> None:
    records = JobRecords(KEYS)
    records.apply(Keys("other").round, encode(ROUND))
    records.apply(KEYS.log(0), encode(LogWindow(0, "a", ())))
    assert records == JobRecords(KEYS)


def test_a_record_of_another_shape_is_unreadable_not_a_crash() -> None:
    body = {"v": FORMAT_VERSION, "round": 1, "what_is_this": True}
    with pytest.raises(RendezvousError, match="unreadable Ping record"):
        decode(Ping, json.dumps(body).encode())
    with pytest.raises(RendezvousError, match="another format version"):
        decode(Ping, json.dumps({"v": FORMAT_VERSION + 1, "round": 1}).encode())
