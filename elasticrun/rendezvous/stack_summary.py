"""The job's stacks in a few lines: identical stacks grouped, the odd ones out named.

Pure: it reads `RankStacks` and returns text, for the agent's log and failure report,
`elasticrun stacks` and `status`.

What an operator needs first is where each rank is stuck, in their own code: a rank
stuck in `load_batch` while 15 others wait in an all-reduce reads as

    rank 3 on node n7: train.py:88 in load_batch; 15 ranks: in all_reduce (train.py:120)

A rank's place (`where`) is therefore named by the innermost frame of user code (not
in the standard library, not in an installed package). When library frames lie inside
it, the summary names the library function the rank is in, `in all_reduce`, and the
user's line that called it. That function is the innermost one of an installed package
(torch's `all_reduce`, below the decorator that wraps it), or, with only the standard
library inside, the one the user's code called (`queue.get`, not `threading.wait`).

Ranks are grouped by their place, the smallest groups first (a group of the others is
large; the odd ones out are what to look at): up to `NAMED` ranks are named with their
nodes, a larger group is counted. The detailed view (`render_groups`) groups ranks by
their whole main-thread stack instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from elasticrun.collectives import COLLECTIVES
from elasticrun.rendezvous.records import Frame, RankStacks, ThreadStack

#: groups of at most this many ranks are named rank by rank, with their nodes
NAMED = 3
#: summary lines at most (one per group); the rest is counted in one more line
LINES = 12

#: a frame of the standard library (…/lib/python3.11/queue.py, but not its site-packages)
_STDLIB = re.compile(r"/lib/python\d+(\.\d+)?t?/(?!(site|dist)-packages/)")
#: a frame of elasticrun's worker helpers (elasticrun/worker/steptime.py, ...)
_WORKER_HELPERS = re.compile(r"/elasticrun/worker/")


def is_installed(file: str) -> bool:
    """A frame of an installed package (site-packages, dist-packages)."""
    return "/site-packages/" in file or "/dist-packages/" in file


def is_library(file: str) -> bool:
    """A frame that is not user code.

    The standard library, an installed package, elasticrun's own worker helpers wherever
    they are (an editable checkout too: the step timing's wrapper lies between the
    user's call and torch's `all_reduce`), or code with no file (`<frozen runpy>`,
    `<string>`: a dataclass's generated methods)."""
    return is_installed(file) or bool(_STDLIB.search(file) or _WORKER_HELPERS.search(file)) or file.startswith("<")


def main_thread(stacks: RankStacks) -> ThreadStack | None:
    return next((t for t in stacks.threads if t.main), stacks.threads[0] if stacks.threads else None)


def _at(frame: Frame) -> str:
    line = str(frame.line) if frame.line else "?"
    return f"{os.path.basename(frame.file)}:{line}"


def where(stacks: RankStacks) -> str:
    """Where a rank is: `train.py:88 in load_batch`, `in all_reduce (train.py:120)`, or `no stack: <why>`."""
    if stacks.missing:
        return f"no stack: {stacks.missing}"
    thread = main_thread(stacks)
    if thread is None or not thread.frames:
        return "no Python frame (in native code outside any Python call, or exiting)"
    frames = thread.frames
    user = next((i for i, f in enumerate(frames) if not is_library(f.file)), None)
    if user is None:
        return f"{_at(frames[0])} in {frames[0].function}"
    mine = frames[user]
    if user == 0:
        return f"{_at(mine)} in {mine.function}"
    inside = frames[:user]
    return f"in {_called(inside).function} ({_at(mine)})"


def _called(inside: Sequence[Frame]) -> Frame:
    """The library function that user code called, of the frames inside it (innermost first)."""
    return next((f for f in inside if is_installed(f.file)), inside[-1])


def collective(stacks: RankStacks) -> str:
    """The torch.distributed collective a rank waits in (`broadcast`), or ""."""
    thread = main_thread(stacks)
    if stacks.missing or thread is None:
        return ""
    frames = thread.frames
    user = next((i for i, f in enumerate(frames) if not is_library(f.file)), None)
    if not user:
        return ""
    name = _called(frames[:user]).function
    return name if name in COLLECTIVES else ""


def mismatch(stacks: Iterable[RankStacks]) -> str:
    """`collective mismatch: rank 0 in broadcast, rank 1 in all_reduce (...)`, or "".

    Every rank waits in a collective, but not all in the same one: they can never meet
    (a certain deadlock, whatever the timeout)."""
    ranks = list(stacks)
    waits = {s.rank: collective(s) for s in ranks}
    names = set(waits.values())
    if len(ranks) < 2 or "" in names or len(names) < 2:
        return ""
    by_name: dict[str, list[int]] = {}
    for rank, name in sorted(waits.items()):
        by_name.setdefault(name, []).append(rank)
    parts = [f"rank{'s' if len(r) > 1 else ''} {ranges(r)} in {name}" for name, r in
             sorted(by_name.items(), key=lambda kv: (len(kv[1]), kv[1][0]))]
    return f"collective mismatch: {', '.join(parts)}: the ranks wait in different collectives and can never meet"


def ranges(ranks: Iterable[int]) -> str:
    """`0-2,4,6-15`."""
    parts: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def _who(group: Sequence[RankStacks], total: int) -> str:
    if len(group) == total and total > NAMED:
        return f"all {total} ranks"
    if len(group) > NAMED:
        return f"{len(group)} ranks"
    nodes = sorted({s.node_id for s in group})
    if len(group) == 1:
        return f"rank {group[0].rank} on node {nodes[0]}"
    ranks = ", ".join(str(s.rank) for s in sorted(group, key=lambda s: s.rank))
    return f"ranks {ranks} on node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)}"


def summarise(stacks: Iterable[RankStacks], lines: int = LINES) -> list[str]:
    """One line per place, the smallest groups (the odd ones out) first.

    `rank 3 on node n7: train.py:88 in load_batch`, `15 ranks: in all_reduce
    (train.py:120)`."""
    stacks = list(stacks)
    groups: dict[str, list[RankStacks]] = {}
    for s in stacks:
        groups.setdefault(where(s), []).append(s)
    total = sum(len(g) for g in groups.values())
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), min(s.rank for s in kv[1])))
    said = [f"{_who(group, total)}: {place}" for place, group in ordered[:lines]]
    rest = ordered[lines:]
    if rest:
        count = sum(len(g) for _, g in rest)
        said.append(f"{len(rest)} more places ({count} ranks): see elasticrun stacks")
    odd = mismatch(stacks)
    return [odd, *said] if odd else said


def one_line(lines: Sequence[str]) -> str:
    """The summary as one line, for a log line and `status`."""
    return "; ".join(lines)


# --- the detailed view ------------------------------------------------------------------


def render_thread(thread: ThreadStack, indent: str = "  ") -> list[str]:
    """A thread as faulthandler writes it, the innermost frame first."""
    head = f"{indent}Thread {thread.thread}{' (main)' if thread.main else ''}, most recent call first:"
    lines = [head]
    for f in thread.frames:
        lines.append(f'{indent}  File "{f.file}", line {f.line or "???"} in {f.function}')
    if thread.more:
        lines.append(f"{indent}  ... {thread.more} more frames")
    if not thread.frames and not thread.more:
        lines.append(f"{indent}  <no Python frame>")
    return lines


def render_rank(stacks: RankStacks, *, all_threads: bool = True) -> list[str]:
    """One rank's stacks (its main thread only, unless `all_threads`)."""
    head = f"rank {stacks.rank} (node {stacks.node_id}, local rank {stacks.local_rank}"
    head += f", pid {stacks.pid})" if stacks.pid else ")"
    if stacks.missing:
        return [f"{head}: no stack: {stacks.missing}"]
    lines = [f"{head}:"]
    threads = stacks.threads if all_threads else [t for t in stacks.threads if t.main][:1] or stacks.threads[:1]
    for thread in threads:
        lines += render_thread(thread)
    left = (len(stacks.threads) - len(threads)) + stacks.more_threads
    if left:
        lines.append(f"  ... {left} more threads{'' if all_threads else ' (--rank shows them)'}")
    return lines


def render_ranks(ranks: Iterable[RankStacks]) -> list[str]:
    """Every rank's stacks, every thread, a blank line after each rank."""
    return [line for r in ranks for line in (*render_rank(r), "")]


@dataclass(frozen=True, slots=True)
class Group:
    """Ranks whose main threads have the same stack (or lack one for the same reason)."""

    ranks: tuple[RankStacks, ...]

    @property
    def first(self) -> RankStacks:
        return self.ranks[0]


def _key(stacks: RankStacks) -> tuple[object, ...]:
    if stacks.missing:
        return ("missing", stacks.missing)
    thread = main_thread(stacks)
    return ("stack", thread.frames if thread else ())


def groups(stacks: Iterable[RankStacks]) -> list[Group]:
    """Ranks grouped by their whole main-thread stack, the smallest groups first."""
    found: dict[tuple[object, ...], list[RankStacks]] = {}
    for s in sorted(stacks, key=lambda s: s.rank):
        found.setdefault(_key(s), []).append(s)
    return sorted((Group(tuple(g)) for g in found.values()), key=lambda g: (len(g.ranks), g.first.rank))


def render_groups(stacks: Iterable[RankStacks]) -> list[str]:
    """Every rank's main-thread stack, each distinct stack once with the ranks that share it."""
    lines: list[str] = []
    for group in groups(stacks):
        ranks = group.ranks
        nodes = sorted({s.node_id for s in ranks})
        shown = ", ".join(nodes[:4]) + (f" and {len(nodes) - 4} more" if len(nodes) > 4 else "")
        who = f"rank {ranks[0].rank}" if len(ranks) == 1 else f"ranks {ranges(s.rank for s in ranks)}"
        lines.append(f"--- {who} ({len(ranks)} on node{'s' if len(nodes) > 1 else ''} {shown}): {where(ranks[0])}")
        if not group.first.missing:
            lines += render_rank(group.first, all_threads=False)[1:]
        lines.append("")
    return lines
