"""How a job ended, from this machine's run folders, once its store is gone.

The store an agent hosts lives in that agent's memory: when it has ended, `elasticrun
status` cannot read the job any more. Each agent also appends its state changes to
`events.jsonl` in its run folder (`<log root>/<run id>_<node id>/`), which outlives it:
the last event of each of this machine's nodes of the job says how it ended there.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from elasticrun.agent.runfolder import DEFAULT_ROOT_PREFIX
from elasticrun.launcher.printable import shown

#: at most this many run folders are shown, the latest first
SHOWN = 8
#: an event's detail (a failure report, say) is cut to this many characters
DETAIL_SHOWN = 240


@dataclass(frozen=True, slots=True)
class LastEvent:
    """A node's last event in its run folder."""

    node: str
    at: float
    kind: str
    detail: str
    folder: Path


def roots(log_dir: Path | None) -> list[Path]:
    """Where this machine's agents put run folders: `log_dir`, else the temporary folders they made."""
    if log_dir is not None:
        return [log_dir]
    return sorted(Path(tempfile.gettempdir()).glob(f"{DEFAULT_ROOT_PREFIX}*"))


def last_events(run_id: str, log_dir: Path | None) -> list[LastEvent]:
    """The last event of each run folder of job `run_id` here, the latest first.

    A folder that cannot be read (another user's, a partial line) is passed over."""
    found = []
    for root in roots(log_dir):
        for events in root.glob(f"{glob_escape(run_id)}_*/events.jsonl"):
            try:
                lines = events.read_text(errors="replace").splitlines()
                last = json.loads(lines[-1]) if lines else None
            except (OSError, ValueError):
                continue
            if isinstance(last, dict) and {"node", "at", "kind", "detail"} <= last.keys():
                found.append(LastEvent(
                    str(last["node"]), float(last["at"]), str(last["kind"]), str(last["detail"]), events.parent
                ))
    return sorted(found, key=lambda e: e.at, reverse=True)[:SHOWN]


def glob_escape(name: str) -> str:
    """`name` matched literally by `Path.glob`."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def render(run_id: str, events: list[LastEvent]) -> str:
    """The lines `status` prints: each node's last state here, when, and why."""
    lines = [f"job '{run_id}' as this machine's run folders last recorded it (the store is gone):"]
    for e in events:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.at))
        lines.append(f"  {shown(e.node)}  {shown(e.kind)}  {when}  {shown(_one_line(e.detail))}")
        lines.append(f"    {shown(str(e.folder))}")
    return "\n".join(lines)


def _one_line(detail: str) -> str:
    """A detail of several lines (a failure report framed by rulers) as one, cut short."""
    parts = [ln.strip(" =-") for ln in detail.splitlines()]
    text = " / ".join(p for p in parts if any(c.isalnum() for c in p))
    return text if len(text) <= DETAIL_SHOWN else text[: DETAIL_SHOWN - 3] + "..."
