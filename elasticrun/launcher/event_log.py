"""--event-log-handler: the agent's status events through torch's event log, as torchrun.

torchrun records `torchelastic.worker.status.<STATE>` events (START for each worker it
starts; SUCCEEDED, FAILED or TERMINATED for each when a run ends; SUCCEEDED or FAILED
for the agent) through `torch.distributed.elastic.events.record(event, handler)`; the
handler names a `logging.Handler` of torch's registry (`console`, `null`, or one a
platform registered). The same events go the same way here, so a platform's handler
sees them. torch is imported only when a handler other than `null` is given: the
launcher and the agent stay torch-free otherwise.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from elasticrun.agent.agent import EventSink, StatusEvent
from elasticrun.errors import UsageError


def torch_event_sink(handler: str, *, run_id: str, role: str, backend: str, entrypoint: str) -> EventSink:
    """A sink that records each event with torch's `events.record(event, handler)`."""
    try:
        from torch.distributed.elastic import events
        from torch.distributed.elastic.events import handlers
    except ImportError as e:
        raise UsageError(f"--event-log-handler={handler} needs torch, which is not importable here ({e})") from None
    try:
        events.get_logging_handler(handler)
    except KeyError:
        known = ", ".join(sorted(handlers._log_handlers))
        raise UsageError(f"--event-log-handler: torch knows no handler {handler!r} (known: {known})") from None
    hostname = socket.getfqdn()

    def record(event: StatusEvent) -> None:
        worker = event.global_rank is not None
        md: dict[str, Any] = {"group_world_size": event.group_world_size, "entry_point": entrypoint}
        if worker:
            md.update(local_rank=(event.local_rank,), role_rank=(event.global_rank,),
                      role_world_size=(event.world_size,), exit_code=(event.exit_code,), worker_pid=(event.pid,))
        metadata: dict[str, Any] = {
            "run_id": run_id,
            "global_rank": event.global_rank,
            "group_rank": event.group_rank,
            "worker_id": str(event.pid) if worker else None,
            "role": role,
            "hostname": hostname,
            "state": event.state,
            "rdzv_backend": backend,
            "metadata": json.dumps(md),
            "agent_restarts": event.restarts,
        }
        source = events.EventSource.WORKER if worker else events.EventSource.AGENT
        events.record(events.Event(f"torchelastic.worker.status.{event.state}", source, metadata=metadata), handler)

    return record
