#!/usr/bin/env python3
"""Run the demo once and write what it printed into README.md, between the demo markers.

    .venv/bin/python scripts/demo_output.py        # runs examples/elastic_demo.py, ~2 minutes

README's demo block is one real run, never pieces of several: before writing, the run's
output is checked by `problems()` (every node id belongs to one demo node throughout,
each status table shows exactly the nodes the demo says are alive, the drained node is
the one the demo drains, rounds only go forward, the job ends with exit code 0).
tests/test_docs.py holds README's block to the same check. A run that fails, or fails
the check, leaves README.md as it was.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DEMO = ROOT / "examples" / "elastic_demo.py"
BEGIN = "<!-- demo-output: written by scripts/demo_output.py -->"
END = "<!-- /demo-output -->"

#: `(node-a = vm_28954, node-b = vm_28955)`: the demo's names of the live nodes' ids
NAMES = re.compile(r"^\((node-\w+ = \S+(?:, node-\w+ = \S+)*)\)$")
JOB_ROW = re.compile(r"^\S+\s+\S+\s+(?P<round>\d+)\s+(?P<world>\d+)\s+(?P<nodes>\d+) \(")
LEADER = re.compile(r"^leader (?P<id>\S+): round (?P<round>\d+) running with (?P<nodes>\d+) nodes?$")
DRAINED = re.compile(r"^drained (?P<ids>\S+(?:, \S+)*) in ")
DRAIN_STAGE = re.compile(r"^=== elasticrun drain .*\((?P<name>node-\w+)\)")


def demo_block(readme: str) -> str:
    """The demo's output as README shows it: the code block between the markers."""
    part = readme.split(BEGIN, 1)[1].split(END, 1)[0]
    return part.split("```text\n", 1)[1].split("```", 1)[0]


@dataclass(frozen=True)
class StatusTable:
    """One `elasticrun status` the demo printed."""

    at: int  #: its line in the output (1-based)
    nodes: list[str]  #: the node ids of its rows
    names: dict[str, str]  #: the demo's names of the live nodes: node-a -> its id (the line after it)
    job: dict[str, str]  #: round, world and nodes of the job row (empty when it has none)
    leader: dict[str, str]  #: id, round and nodes of the leader line (empty when it has none)


def status_tables(lines: list[str]) -> list[StatusTable]:
    """Every `elasticrun status` in the demo's output, in order."""
    tables = []
    for i, line in enumerate(lines):
        if not line.startswith("$ elasticrun status"):
            continue
        job: dict[str, str] = {}
        leader: dict[str, str] = {}
        nodes: list[str] = []
        names: dict[str, str] = {}
        rows = iter(lines[i + 1:])
        for row in rows:
            if row.startswith("NODE "):
                break
            if found := JOB_ROW.match(row):
                job = found.groupdict()
            elif found := LEADER.match(row):
                leader = found.groupdict()
        for row in rows:
            if found := NAMES.match(row):
                names = dict(pair.split(" = ") for pair in found.group(1).split(", "))
                break
            if row:
                nodes.append(row.split()[0])
        tables.append(StatusTable(i + 1, nodes, names, job, leader))
    return tables


def problems(output: str) -> list[str]:
    """What shows that `output` is not one whole run of the demo (nothing when it is)."""
    lines = [line.strip() for line in output.splitlines()]
    tables = status_tables(lines)
    if not tables:
        return ["no `elasticrun status` table"]
    found = []
    id_of: dict[str, str] = {}
    name_of: dict[str, str] = {}
    last_round = 0
    for table in tables:
        where = f"the status table at line {table.at}"
        for name, node_id in table.names.items():
            if id_of.setdefault(name, node_id) != node_id:
                found.append(f"{where}: {name} is {node_id}, earlier {id_of[name]}")
            if name_of.setdefault(node_id, name) != name:
                found.append(f"{where}: {node_id} is {name}, earlier {name_of[node_id]}")
        live = sorted(table.names.values())
        if sorted(table.nodes) != live:
            found.append(f"{where}: the table shows {sorted(table.nodes)}, the demo's live nodes are {live}")
        job, leader, rows = table.job, table.leader, len(table.nodes)
        if not job or not leader:
            found.append(f"{where}: no job row or no leader line")
            continue
        if {int(job["world"]), int(job["nodes"]), int(leader["nodes"])} != {rows}:
            said = f"world {job['world']}, {job['nodes']} nodes, the leader's {leader['nodes']}"
            found.append(f"{where}: {said}; {rows} rows")
        if leader["id"] not in table.nodes:
            found.append(f"{where}: the leader {leader['id']} is not among its nodes")
        if not int(job["round"]) == int(leader["round"]) > last_round:
            found.append(f"{where}: round {job['round']} (the leader's {leader['round']}) after round {last_round}")
        last_round = int(job["round"])
    stage = ""
    for i, line in enumerate(lines):
        stage = line if line.startswith("=== ") else stage
        drained = DRAINED.match(line)
        meant = DRAIN_STAGE.match(stage)
        for node_id in drained.group("ids").split(", ") if drained else []:
            if node_id not in name_of:
                found.append(f"line {i + 1}: drained {node_id}, a node no status table shows")
            elif meant and name_of[node_id] != meant.group("name"):
                found.append(f"line {i + 1}: drained {node_id} ({name_of[node_id]}), not {meant.group('name')}")
            later = [t.at for t in tables if t.at > i and node_id in t.nodes]
            if later:
                found.append(f"line {i + 1}: drained {node_id}, still in the status table at line {later[0]}")
    if not lines or not lines[-1].startswith("node-a exited 0; "):
        found.append("the run does not end with node-a's exit code 0")
    return found


def run_demo() -> tuple[int, str, float]:
    """Run the demo, its output passed through as it comes; (exit code, output, seconds)."""
    env = {k: v for k, v in os.environ.items() if k != "KEEP_DEMO_LOGS"}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(DEMO)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    printed = []
    for line in proc.stdout:
        sys.stdout.write(line)
        printed.append(line)
    return proc.wait(), "".join(printed), time.monotonic() - start


def main() -> int:
    if any(marker not in README.read_text() for marker in (BEGIN, END)):
        print(f"demo_output.py: README.md lacks the markers {BEGIN} and {END}", file=sys.stderr)
        return 1
    load = os.getloadavg()[0]
    code, output, seconds = run_demo()
    output = output.strip("\n") + "\n"
    if code != 0:
        print(f"demo_output.py: the demo exited {code}; README.md left as it was", file=sys.stderr)
        return 1
    found = problems(output)
    if found:
        print("demo_output.py: not one run; README.md left as it was:", *found, sep="\n  ", file=sys.stderr)
        return 1
    head, rest = README.read_text().split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    block = (
        f"One real run on {os.cpu_count()} cores, load average {load:.1f} when it started, {seconds:.0f} s"
        " (node ids, ages and losses vary from run to run):\n\n"
        f"```text\n{output}```\n"
    )
    README.write_text(f"{head}{BEGIN}\n{block}{END}{tail}")
    print(f"README.md: the demo's output written ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
