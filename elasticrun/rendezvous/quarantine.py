"""QuarantineBook: the quarantine table while the leader makes one decision.

Worker failures attributed to a node and its drops out of a round are counted; after
`quarantine_after` of them the node is kept out of rounds for a cooldown that doubles
with each repeat (`RendezvousSettings.cooldown`). The book is a working copy of the
stored `QuarantineTable`: `decide_round()` counts and holds in it, and hands the table back
for the leader to store when it changed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

from elasticrun.rendezvous.records import QuarantineEntry, QuarantineTable
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.rendezvous.view import SeenNode
from elasticrun.rendezvous.wording import names, plural

#: the most nodes the quarantine table remembers (the oldest quiet ones go first)
QUARANTINE_ENTRIES_KEPT = 1024


class QuarantineBook:
    """The quarantine table while one decision is made: a local working copy.

    A node's record is forgotten once it has been quiet (no failure, no quarantine)
    for `quarantine_cooldown_max`; until then a node released from quarantine is on
    probation: its next failure quarantines it again, for twice as long.
    """

    def __init__(self, table: QuarantineTable, settings: RendezvousSettings, now: float) -> None:
        self.settings = settings
        self.now = now
        self.counted = table.counted_round
        window = settings.quarantine_cooldown_max
        kept = [e for e in table.entries if now - max(e.last_failure_at, e.until) <= window]
        if len(kept) > QUARANTINE_ENTRIES_KEPT:
            kept.sort(key=lambda e: (not e.active(now), -max(e.last_failure_at, e.until)))
            kept = kept[:QUARANTINE_ENTRIES_KEPT]
        self.entries = {e.node_id: e for e in kept}
        #: nodes this decision quarantined
        self.new: list[str] = []

    def table(self) -> QuarantineTable:
        return QuarantineTable(entries=tuple(self.entries[n] for n in sorted(self.entries)), counted_round=self.counted)

    def blocked(self, node_id: str) -> bool:
        entry = self.entries.get(node_id)
        return entry is not None and entry.active(self.now)

    def held(self) -> set[str]:
        """The nodes `blocked` now: one set to test thousands of nodes against."""
        return {n for n, e in self.entries.items() if e.active(self.now)}

    def arrival(self, node: SeenNode) -> float:
        """When a newcomer counts as arrived: when the leader saw it, or its release."""
        entry = self.entries.get(node.info.node_id)
        if entry is not None and not entry.active(self.now):
            return max(node.seen_at, entry.until)
        return node.seen_at

    def counts(self, number: int) -> bool:
        """Whether the failures of round `number` are still to count (then they are)."""
        if self.settings.quarantine_after <= 0 or number <= self.counted:
            return False
        self.counted = number
        return True

    def count(self, node_id: str, failure: str) -> None:
        """Count one failure of `node_id`; quarantine it when that makes enough."""
        s = self.settings
        entry = self.entries.get(node_id) or QuarantineEntry(node_id=node_id)
        quiet = entry.last_failure_at and self.now - entry.last_failure_at > s.quarantine_cooldown_max
        failures = (0 if quiet else entry.failures) + 1
        threshold = 1 if entry.times else s.quarantine_after  # released ones are on probation
        if failures < threshold:
            self.entries[node_id] = replace(entry, failures=failures, reason=failure, last_failure_at=self.now)
            return
        why = (
            f"{plural(failures, 'failure')}, the latest: {failure}" if threshold > 1
            else f"again after its release: {failure}"
        )
        self.hold(node_id, why)

    def hold(self, node_id: str, reason: str) -> None:
        """Quarantine `node_id` now, for a cooldown that doubles with each time.

        After enough failures (`count`), or at once when the node asked to be kept out."""
        entry = self.entries.get(node_id) or QuarantineEntry(node_id=node_id)
        times = entry.times + 1
        self.entries[node_id] = replace(
            entry, failures=0, times=times, until=self.now + self.settings.cooldown(times), reason=reason,
            last_failure_at=self.now,
        )
        self.new.append(node_id)

    def undo_hold(self, node_id: str, before: QuarantineEntry | None) -> None:
        """Take back the latest `hold(node_id)`: the node's record is `before` again."""
        self.new.remove(node_id)
        if before is None:
            del self.entries[node_id]
        else:
            self.entries[node_id] = before

    def release_at(self, registered: Mapping[str, SeenNode]) -> float | None:
        """When the first registered node under quarantine is released (to look again)."""
        ends = [e.until for n, e in self.entries.items() if n in registered and e.active(self.now)]
        return min(ends) if ends else None

    def held_note(self, registered: Mapping[str, SeenNode], group: Collection[str]) -> str:
        """`; quarantined: x` for the registered nodes kept out of `group`."""
        held = sorted(n for n in self.held() if n in registered and n not in group)
        return f"; quarantined: {names(held)}" if held else ""
