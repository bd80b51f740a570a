"""--logs-specs: a torchrun `LogsSpecs` lays out the workers' log files, as under torchrun.

torchrun loads the class that the entry point NAME of the group `torchrun.logs_specs`
names (torch registers `default`, its DefaultLogsSpecs), builds it from `--log-dir`,
`--redirects`, `--tee` and `--local-ranks-filter`, and calls its `reify(envs)` for each
attempt: the returned paths are each worker's stdout, stderr and error file, and the
streams it tees to the console. The same class does the same here; the agent then
writes and follows those files as it does its own. torch is imported only with the flag.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

from elasticrun.agent.agent import LogLayout
from elasticrun.agent.output import StreamPlan
from elasticrun.agent.spec import Std
from elasticrun.errors import UsageError

GROUP = "torchrun.logs_specs"


def torch_log_layout(
    name: str, *, log_dir: str | None, redirects: str, tee: str, local_ranks_filter: frozenset[int] | None
) -> LogLayout:
    """The layout of the LogsSpecs class registered as `name`."""
    found = {ep.name: ep for ep in metadata.entry_points(group=GROUP)}
    if name not in found:
        known = ", ".join(sorted(found)) or "none"
        raise UsageError(f"--logs-specs: no entry point {name!r} in the group {GROUP} (known: {known})")
    try:
        from torch.distributed.elastic.multiprocessing.api import Std as TorchStd

        specs_class = found[name].load()
        specs = specs_class(
            log_dir=log_dir, redirects=TorchStd.from_str(redirects), tee=TorchStd.from_str(tee),
            local_ranks_filter=set(local_ranks_filter) if local_ranks_filter else None,
        )
    except ImportError as e:
        raise UsageError(f"--logs-specs={name}: cannot load it: {e}") from None

    def layout(envs: dict[int, dict[str, str]]) -> dict[int, tuple[dict[Std, StreamPlan], Path]]:
        dest = specs.reify(envs)
        result = {}
        for rank in envs:
            plans = {
                std: _plan(files.get(rank, ""), rank in tees)
                for std, files, tees in ((Std.OUT, dest.stdouts, dest.tee_stdouts),
                                         (Std.ERR, dest.stderrs, dest.tee_stderrs))
            }
            result[rank] = (plans, Path(dest.error_files.get(rank) or os.devnull))
        return result

    return layout


def _plan(path: str, teed: bool) -> StreamPlan:
    """torchrun's destination of one stream.

    "" the console, os.devnull nowhere, else the file (and the console too when teed)."""
    if not path:
        return StreamPlan(console=True, file=None)
    if path == os.devnull:
        return StreamPlan(console=False, file=None)
    return StreamPlan(console=teed, file=Path(path))
