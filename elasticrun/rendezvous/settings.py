"""RendezvousSettings: how the rendezvous forms rounds, one set per job.

The launcher builds them from `--rdzv-conf` and the flags (`launcher/rdzv_conf.py`);
the registration, the leader's decision, the quarantine and the straggler verdict read
them. A module of their own, below all of those.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RendezvousSettings:
    """How the rendezvous forms rounds; one job, one set of settings.

    The defaults are chosen for fast recovery: a dead node is noticed within
    `heartbeat_ttl`, a formation or scale-up waits `last_call` for stragglers.
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    #: after `min_nodes` are registered (or a newcomer arrives), wait this long for more
    last_call: float = 1.0
    #: a node that gets no place in a round within this time gives up; counted only
    #: while no round runs, unless `spares_wait` is off
    join_timeout: float = 600.0
    #: a spare waits as long as the job runs; off for `elasticrun join --timeout`,
    #: whose operator bounds the wait for a place
    spares_wait: bool = True
    #: when the store an agent hosted refuses us (its agent is gone), how long to wait
    #: for a new one at the same endpoint (the head restarted by its scheduler)
    store_host_grace: float = 30.0
    #: lease TTL: a node that stops renewing is removed after this long
    heartbeat_ttl: float = 5.0
    #: how long a closed job stays closed, so late agents exit instead of starting anew
    closed_ttl: float = 60.0
    #: seconds between lease renewals; 0: a third of heartbeat_ttl
    heartbeat_interval: float = 0.0
    #: failures of one node (worker failures attributed to it, drops out of a round)
    #: after which it is quarantined; 0: never
    quarantine_after: int = 3
    #: seconds of a node's first quarantine; each further one lasts twice as long
    quarantine_cooldown: float = 60.0
    #: the longest quarantine; a node quiet this long has its record forgotten
    quarantine_cooldown_max: float = 3600.0
    #: every round's node count is a multiple of this (`--node-unit`; min_nodes and
    #: max_nodes are multiples too): the registered nodes left over wait as spares
    node_unit: int = 1
    #: --straggler: off (no step timing), report (name stragglers), replace (and take
    #: one out when a spare or the elastic range allows; elasticrun.rendezvous.stragglers)
    straggler: str = "report"
    #: a node is slow when its compute time per step is this many times the other nodes' median
    straggler_relative: float = 1.25
    #: evaluations in a row that find a node slow before it is named (and not, before it is cleared)
    straggler_after: int = 3
    #: seconds between evaluations, and between a node's step reports
    straggler_interval: float = 5.0

    @staticmethod
    def default_heartbeat_ttl(max_nodes: int) -> float:
        """5 s, or longer for a job that may grow past 2,000 nodes.

        Each node renews its lease three times a TTL, so a TTL of max_nodes / 400 s
        holds the store's keep-alives near 1,200 a second at any size (what both stores
        served on two cores with room to spare; BENCHMARKS.md). A dead agent is still
        found within about a second by its liveness port; only a vanished host waits out
        the TTL."""
        return max(5.0, max_nodes / 400)

    @property
    def keep_alive_interval(self) -> float:
        return self.heartbeat_interval or self.heartbeat_ttl / 3

    def cooldown(self, times: int) -> float:
        """How long a node's `times`-th quarantine lasts."""
        return min(self.quarantine_cooldown * 2.0 ** min(max(times - 1, 0), 64), self.quarantine_cooldown_max)
