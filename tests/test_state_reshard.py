"""A sharded state at a new world size, or with its ranks moved: re-sharded from every shard.

End to end with real agents as nodes on loopback, a real store and gloo workers
(tests/workers/reshard_worker.py, a vector split over the ranks in a ShardedState):
the world grows and each rank gathers the old slices its new one overlaps; a node is
lost and its slice comes from the copy its buddy kept; a node lost with its buddy is
said gone and the script starts afresh; a fixed-size job whose replacement comes in
elsewhere resumes every shard. And which earlier commit is offered, on its own.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from elasticrun.worker.elastic import EarlierShards, ShardedState
from tests.support.elastic_cluster import RDZV_CONF, Cluster, Proc
from tests.support.helpers import wait_until
from tests.test_elastic_agents import node_id

pytestmark = pytest.mark.timeout(180)


def test_the_earlier_commit_is_the_newest_whole_one_else_the_newest_with_its_lost_ranks() -> None:
    """What the group's records (commits, round, rank, world size) offer to re-shard from."""
    state = ShardedState(step=0)
    # commit 7 of world 2 lost its rank 1 (its worker died mid-copy); commit 6 is whole
    offered = EarlierShards.of([[(6, 1, 0, 2), (7, 1, 0, 2)], [(6, 1, 1, 2)], []], state)
    assert offered is not None and (offered.world, offered.commits, offered.lost) == (2, 6, ())
    # a later round that started afresh counts from 1 again: it is still the newest
    offered = EarlierShards.of([[(9, 1, 0, 1), (2, 3, 0, 1)]], state)
    assert offered is not None and (offered.world, offered.commits, offered.lost) == (1, 2, ())
    # nothing whole: the newest, with the ranks no worker holds
    offered = EarlierShards.of([[(4, 2, 2, 4)], [(4, 2, 0, 4)]], state)
    assert offered is not None and (offered.world, offered.commits, offered.lost) == (4, 4, (1, 3))
    assert EarlierShards.of([[], []], state) is None


RESHARD_WORKER = Path(__file__).resolve().parent / "workers" / "reshard_worker.py"
RESHARD_BEGIN = re.compile(
    r"begin rank=(?P<rank>\d+) world=(?P<world>\d+) restored=(?P<restored>\w+) earlier=(?P<earlier>\S+) "
    r"lost=\[(?P<lost>[\d, ]*)\] step=(?P<step>\d+) intact=(?P<intact>\w+) from=(?P<source>[a-z ]+)"
)


def resharding_node(cluster: Cluster, store: str, run_id: str, name: str, nnodes: str) -> Proc:
    return cluster.agent(
        name, backend="c10d", endpoint=store, run_id=run_id, local_addr="127.0.0.1", nnodes=nnodes,
        conf=f"{RDZV_CONF},is_host=false", worker=RESHARD_WORKER, worker_args=("--hold-at=6",),
    )


def held_and_copied(cluster: Cluster, store: str, run_id: str, nodes: list[Proc], commit: int) -> None:
    """Wait until `status` shows every node holding commit `commit` and its buddy a copy of it."""
    def done() -> bool:
        shown = cluster.control("status", "--json", "--rdzv-backend=c10d", f"--rdzv-endpoint={store}",
                                f"--rdzv-id={run_id}")
        if shown.returncode != 0:
            return False
        status = {n["node_id"]: n.get("status") or {} for n in json.loads(shown.stdout)["nodes"]}
        return all(
            ((status.get(node_id(n)) or {}).get("state_held"), (status.get(node_id(n)) or {}).get("state_replicated"))
            == (commit, commit)
            for n in nodes
        )
    wait_until(done, 60, f"every node's commit {commit} held and copied to its buddy")


def test_a_sharded_state_is_resharded_from_every_shard_when_the_world_grows(cluster: Cluster, c10d_store: str) -> None:
    """Two nodes commit their halves up to step 6; a third joins: at world 3 no rank has
    a commit of its own rank and size, so none restores, and `earlier` offers commit 6
    of world 2 whole. Each rank gathers the old halves its third overlaps (the middle
    rank needs both halves, one from another worker) and resumes at step 6 with exactly that
    step's values."""
    run_id = f"reshard-{os.getpid()}-grow"
    first = [resharding_node(cluster, c10d_store, run_id, f"n{i}", "2:3") for i in (1, 2)]
    for node in first:
        node.wait_for(r"step=6 rank=\d world=2")
    third = resharding_node(cluster, c10d_store, run_id, "n3", "2:3")
    nodes = [*first, third]
    for node in nodes:
        assert node.wait_exit() == 0, node.text()[-4000:]
    begins = [m for node in nodes for m in RESHARD_BEGIN.finditer(node.text()) if m["world"] == "3"]
    assert sorted(int(m["rank"]) for m in begins) == [0, 1, 2], [n.text()[-2000:] for n in nodes]
    for m in begins:
        seen = (m["restored"], m["earlier"], m["lost"], m["step"], m["intact"])
        assert seen == ("False", "2/6", "", "6", "True"), m[0]
    cluster.assert_no_orphans()


def three_nodes_at_step_6(cluster: Cluster, store: str, run_id: str, nnodes: str) -> dict[int, Proc]:
    """Three nodes of one worker each, holding their thirds at step 6, each copied to the next: by rank."""
    nodes = [resharding_node(cluster, store, run_id, f"n{i}", nnodes) for i in (1, 2, 3)]
    ranks = {int(node.wait_for(r"begin rank=(\d) world=3")[1]): node for node in nodes}
    for node in nodes:
        node.wait_for(r"step=6 rank=\d world=3")
    held_and_copied(cluster, store, run_id, nodes, 6)
    return ranks


def test_a_lost_nodes_shards_come_from_the_copy_its_buddy_kept(cluster: Cluster, c10d_store: str) -> None:
    """Of two nodes holding their halves at step 6, copied to each other, one is SIGKILLed
    with its memory: the survivor, alone at world 1, finds the lost half in the copy its
    agent kept, gathers both and resumes at step 6 with exactly that step's values."""
    run_id = f"reshard-{os.getpid()}-copied"
    nodes = [resharding_node(cluster, c10d_store, run_id, f"n{i}", "1:2") for i in (1, 2)]
    for node in nodes:
        node.wait_for(r"step=6 rank=\d world=2")
    held_and_copied(cluster, c10d_store, run_id, nodes, 6)
    nodes[1].kill()
    survivor = nodes[0]
    assert survivor.wait_exit() == 0, survivor.text()[-4000:]
    first, again = RESHARD_BEGIN.finditer(survivor.text())
    assert (first["world"], again["world"]) == ("2", "1"), survivor.text()[-4000:]
    seen = (again["restored"], again["earlier"], again["lost"], again["step"], again["intact"])
    assert seen == ("False", "2/6", "", "6", "True"), again[0]
    assert "no shard of ranks" not in survivor.text()
    cluster.assert_no_orphans()


def test_a_node_lost_with_its_buddy_is_said_gone_and_the_script_starts_afresh(
    cluster: Cluster, c10d_store: str
) -> None:
    """Of three nodes holding their thirds at step 6, each copied to the next, two next to
    each other are SIGKILLed: the survivor holds its own third and its predecessor's copy,
    so at world 1 it is told in one line that the third rank's shard is gone, its
    `earlier` names that rank lost, and it starts from step 0."""
    ranks = three_nodes_at_step_6(cluster, c10d_store, f"reshard-{os.getpid()}-lost", "1:3")
    survivor = ranks[0]
    ranks[1].kill()
    ranks[2].kill()
    assert survivor.wait_exit() == 0, survivor.text()[-4000:]
    again = [m for m in RESHARD_BEGIN.finditer(survivor.text()) if m["world"] == "1"]
    assert len(again) == 1, survivor.text()[-4000:]
    seen = (again[0]["restored"], again[0]["earlier"], again[0]["lost"], again[0]["step"], again[0]["intact"])
    assert seen == ("False", "3/6", "1", "0", "True"), again[0][0]  # rank 2's third: rank 0 kept its copy
    said = "elasticrun: no shard of ranks [1] of the last commit (6, made at world size 3) is left"
    assert survivor.text().count(said) == 1, survivor.text()[-4000:]
    cluster.assert_no_orphans()


def test_a_fixed_size_job_resumes_every_shard_when_a_new_node_comes_in_elsewhere(
    cluster: Cluster, c10d_store: str
) -> None:
    """Three nodes of a fixed-size job hold their thirds at step 6, each copied to the next;
    one is SIGKILLed and, with no spare, the job waits; a new node comes: whatever node ranks
    the round gives (the survivors may move), every rank resumes its own third of step 6,
    from its own memory, a peer or the copy its agent kept, exactly as it was."""
    run_id = f"reshard-{os.getpid()}-fixed"
    ranks = three_nodes_at_step_6(cluster, c10d_store, run_id, "3")
    marks = {rank: node.mark() for rank, node in ranks.items()}
    ranks[1].kill()
    for rank in (0, 2):  # the round is over and the job waits: the next forms anew
        ranks[rank].wait_for(r"node \S+ waiting", start=marks[rank])
    newcomer = resharding_node(cluster, c10d_store, run_id, "n4", "3")
    finished = [ranks[0], ranks[2], newcomer]
    for node in finished:
        assert node.wait_exit() == 0, node.text()[-4000:]
    again = [m for node in finished for m in RESHARD_BEGIN.finditer(node.text()) if m["step"] != "0"]
    assert sorted(int(m["rank"]) for m in again) == [0, 1, 2], [n.text()[-2000:] for n in finished]
    for m in again:
        seen = (m["world"], m["restored"], m["earlier"], m["step"], m["intact"])
        assert seen == ("3", "True", "none", "6", "True"), m[0]
    cluster.assert_no_orphans()
