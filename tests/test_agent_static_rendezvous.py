"""The static rendezvous: one fixed place, local restarts, closing, bad input."""

from __future__ import annotations

import pytest

from elasticrun.errors import RendezvousClosedError, RendezvousError, UsageError
from elasticrun.rendezvous.static import StaticRendezvous


def _static(node_rank: int = 1, nnodes: int = 3, port: int = 29500) -> StaticRendezvous:
    return StaticRendezvous(
        "job", node_rank=node_rank, nnodes=nnodes, nproc_per_node=4,
        master_addr="10.0.0.1", master_port=port,
    )


async def test_assignment_and_restarts_counted_locally() -> None:
    rdzv = _static()
    first = await rdzv.next_round()
    assert (first.round, first.node_rank, first.node_count) == (0, 1, 3)
    assert (first.rank_offset, first.world_size, first.restart_count) == (4, 12, 0)
    assert (first.master_addr, first.master_port) == ("10.0.0.1", 29500)
    with pytest.raises(RendezvousError, match="no new round"):
        await rdzv.next_round()
    await rdzv.request_restart("rank 5 failed")
    second = await rdzv.next_round()
    assert (second.round, second.restart_count, second.rank_offset) == (1, 1, 4)


@pytest.mark.parametrize(
    ("close", "outcome"),
    [("finish", "succeeded"), ("fail", "failed"), ("leave", "stopped")],
)
async def test_closing_ends_the_rounds(close: str, outcome: str) -> None:
    rdzv = _static()
    await rdzv.next_round()
    if close == "finish":
        await rdzv.finish()
    else:
        await getattr(rdzv, close)("why")
    with pytest.raises(RendezvousClosedError) as info:
        await rdzv.next_round()
    assert info.value.outcome == outcome


@pytest.mark.parametrize(
    ("node_rank", "nnodes", "port", "flag"),
    [(3, 3, 29500, "--node-rank"), (-1, 3, 29500, "--node-rank"),
     (0, 0, 29500, "--nnodes"), (0, 1, 0, "--master-port"), (0, 1, 70000, "--master-port")],
)
def test_bad_input_names_the_flag(node_rank: int, nnodes: int, port: int, flag: str) -> None:
    with pytest.raises(UsageError, match=flag):
        _static(node_rank, nnodes, port)


@pytest.mark.parametrize(
    ("node_rank", "nnodes", "said"),
    [
        (0, 3, "static rendezvous: node rank 0 of 3: its rank-0 worker hosts the job's store at 10.0.0.1:29500; "
               "the workers wait there for node ranks 1-2 (each started with its own --node-rank)"),
        (1, 2, "static rendezvous: node rank 1 of 2: the workers wait for node rank 0, whose rank-0 worker hosts "
               "the job's store at 10.0.0.1:29500, and for every other node rank"),
    ],
)
async def test_a_static_node_says_once_what_its_workers_wait_for(
    caplog: pytest.LogCaptureFixture, node_rank: int, nnodes: int, said: str
) -> None:
    """Nothing is negotiated, so nothing else tells a user why a node waits in silence."""
    rdzv = _static(node_rank, nnodes)
    with caplog.at_level("INFO", logger="elasticrun.rendezvous"):
        await rdzv.next_round()
        await rdzv.request_restart("rank 5 failed")
        await rdzv.next_round()
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("static rendezvous: node")] == [said]
