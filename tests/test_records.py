"""The record codec: every record survives the store as JSON, and each key of a job
becomes its record in one place (`JobRecords`), whoever reads it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from elasticrun.errors import RendezvousError
from elasticrun.rendezvous.codec import FORMAT_VERSION, decode, encode
from elasticrun.rendezvous.job_records import JobRecords
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.records import (
    RUN_PATH_MODULE,
    Departure,
    DrainRequest,
    Event,
    JobLaunch,
    JobSpec,
    LeaderState,
    LogLine,
    LogWindow,
    Master,
    NodeInfo,
    NodeStatus,
    Ping,
    QuarantineEntry,
    QuarantineTable,
    Record,
    RestartRequest,
)
from elasticrun.rendezvous.rounds import Participant, Round, RoundHead, shard_of, split_round

KEYS = Keys("job")
NODE = NodeInfo("a", "host", "10.0.0.1", 2, 7, 1.5, gpus=("H100", "H100"), ran_round=3, ran_restarts=1)
ROUND = Round(4, (Participant("a", "10.0.0.1", 2), Participant("b", "10.0.0.2", 1)), 1, "node b joined", 9.5)
HEAD, SHARDS = split_round(ROUND, "a", None, None)
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
    (KEYS.round, HEAD),
    *((KEYS.shard(HEAD.ranks, i), shard) for i, shard in enumerate(SHARDS)),
    (KEYS.master, Master(4, "10.0.0.1", 29500)),
    (KEYS.ping, Ping(4)),
    (KEYS.spec, SPEC),
    (KEYS.state, LeaderState("a", "waiting", 2, 3.0, waiting=("c",))),
    (KEYS.launch, JobLaunch("/work", 1.0, "a")),
    (KEYS.drain("a"), DrainRequest("scale in", 2.0)),
    (KEYS.departure("a"), Departure("the agent received SIGTERM")),
    (KEYS.quarantine, QUARANTINE),
    (KEYS.hold("b"), QUARANTINE.entries[0]),
    (KEYS.status("a"), STATUS),
    (KEYS.event(2.0, "a"), Event(2.0, "a", "round", "round 4")),
]


@pytest.mark.parametrize(
    "record", [r for _, r in SAMPLES] + [ROUND, LogWindow(3, "a", (LogLine(1, "stdout", "hi"),))]
)
def test_every_record_survives_the_store_with_its_nested_records_and_tuples(record: Record) -> None:
    assert decode(type(record), encode(record)) == record


def test_each_key_becomes_its_record_and_a_deleted_key_forgets_it() -> None:
    records = JobRecords(KEYS)
    for key, record in SAMPLES:
        records.apply(key, encode(record), revision=7)
    records.apply(KEYS.leader, b"a")
    assert (records.nodes, records.acks, records.statuses) == ({"a": NODE}, {"a": Ping(4)}, {"a": STATUS})
    assert (records.round, records.round_revision, records.spec, records.leader) == (ROUND, 7, SPEC, "a")
    assert records.quarantine == QUARANTINE and records.holds == {"b": QUARANTINE.entries[0]}
    assert list(records.drains) == ["a"] and list(records.departures) == ["a"] and len(records.events) == 1
    for key, _ in SAMPLES:
        records.apply(key, None)
    records.apply(KEYS.leader, None)
    assert records == JobRecords(KEYS)


def test_keys_of_other_jobs_and_output_windows_are_not_kept() -> None:
    records = JobRecords(KEYS)
    records.apply(Keys("other").round, encode(HEAD))
    records.apply(KEYS.log(0), encode(LogWindow(0, "a", ())))
    assert records == JobRecords(KEYS)


def test_a_record_of_another_shape_is_unreadable_not_a_crash() -> None:
    body = {"v": FORMAT_VERSION, "round": 1, "what_is_this": True}
    with pytest.raises(RendezvousError, match="unreadable Ping record"):
        decode(Ping, json.dumps(body).encode())
    with pytest.raises(RendezvousError, match="another format version"):
        decode(Ping, json.dumps({"v": FORMAT_VERSION + 1, "round": 1}).encode())


def _round(n: int, number: int = 7) -> Round:
    members = tuple(Participant(f"node{i:05d}", f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 8) for i in range(n))
    return Round(number, members, 0, f"{n} nodes registered", 1.7e9)


def _read_per_round(stored: Round) -> tuple[float, int]:
    """The bytes a node reads of `stored` (the head its watch brings and the one shard
    its id hashes to): on average over the nodes, and the most any one reads."""
    head, shards = split_round(stored, "node00000", None, None)
    encoded = [len(encode(s)) for s in shards]
    each = [len(encode(head)) + encoded[shard_of(p.node_id, head.shards)] for p in stored.participants]
    return sum(each) / len(each), max(each)


def test_what_a_node_reads_of_a_round_does_not_grow_with_the_job() -> None:
    # Before the round was split, every node read every member: 53 KB at 1,000 nodes,
    # 540 KB at 10,000 (O(N) per node, O(N^2) per round).
    (mean_1k, _), (mean_10k, most_10k) = _read_per_round(_round(1_000)), _read_per_round(_round(10_000))
    assert mean_10k <= 1.1 * mean_1k, (mean_1k, mean_10k)
    assert most_10k < 12_000, most_10k


def test_a_round_split_into_shards_is_put_back_together_with_every_rank_and_offset() -> None:
    stored = _round(1_000)
    head, shards = split_round(stored, "node00000", None, None)
    records = JobRecords(KEYS)
    records.apply(KEYS.round, encode(head))
    assert records.round is None  # the members are not all read yet
    for i, shard in enumerate(shards):
        records.apply(KEYS.shard(head.ranks, i), encode(shard))
    assert records.round == stored
    placed = {p.node_id: p for s in shards for p in s.placed}
    assert (placed["node00010"].rank, placed["node00010"].offset) == (10, 80)
    assert (head.nodes, head.world_size) == (1_000, 8_000)


def test_a_round_keeps_since_the_last_round_that_lost_a_member() -> None:
    first = _round(4, number=1)
    head1, _ = split_round(first, "a", None, None)
    grown = _round(5, number=2)  # a newcomer: nobody lost
    head2, _ = split_round(grown, "a", head1, first)
    shrunk = _round(3, number=3)  # a member gone
    head3, _ = split_round(shrunk, "a", head2, grown)
    assert (head1.kept_since, head2.kept_since, head3.kept_since) == (1, 1, 3)


def test_a_closed_round_reads_without_its_members() -> None:
    records = JobRecords(KEYS)
    records.apply(KEYS.round, encode(replace(HEAD, closed="failed")))
    assert records.round is not None and records.round.closed == "failed"
    assert isinstance(records.head, RoundHead)


@pytest.mark.parametrize(
    ("theirs", "mine"),
    [
        (("train.py", "--epochs", "3"), ("/home/me/code/train.py", "--epochs", "3")),
        (("../x/train.py",), ("train.py",)),
        (("-m", RUN_PATH_MODULE, "train.py", "--lr=1"), ("-m", RUN_PATH_MODULE, "a/train.py", "--lr=1")),
    ],
)
def test_the_same_script_by_another_path_is_the_same_spec(theirs: tuple[str, ...], mine: tuple[str, ...]) -> None:
    """Code sits at different paths on different nodes: the script's name and arguments must agree."""
    assert JobSpec(command=theirs).differences(JobSpec(command=mine)) == []


@pytest.mark.parametrize(
    ("theirs", "mine"),
    [
        (("train.py", "--epochs", "3"), ("/home/me/code/train.py", "--epochs", "4")),  # its arguments
        (("train.py",), ("code/eval.py",)),  # another script
        (("-m", "pkg.train"), ("-m", "other.train")),  # another module
    ],
)
def test_another_script_or_other_arguments_differ(theirs: tuple[str, ...], mine: tuple[str, ...]) -> None:
    (line,) = JobSpec(command=theirs).differences(JobSpec(command=mine))
    assert line == f"command: job has {list(theirs)!r}, this node {list(mine)!r}"
