"""The HTTP endpoint that serves a registry of Prometheus metrics (`--metrics-port`).

prometheus_client's own server, in daemon threads of this process: a scrape reads the
metrics there, never waiting for the agent's or the store's event loop, and they never
wait for it. Off unless the flag is given; the library is imported only then.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticrun.errors import UsageError
from elasticrun.loglines import HEADLINE

if TYPE_CHECKING:  # the library is imported only when metrics are served
    from prometheus_client import CollectorRegistry

log = logging.getLogger("elasticrun")


@dataclass(frozen=True, slots=True)
class MetricsAddress:
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"


def metrics_address(
    value: str | None, flag: str = "--metrics-port", default_host: str = "0.0.0.0"
) -> MetricsAddress | None:
    """`PORT` (on `default_host`: every interface unless told) or `HOST:PORT`; None (not given): no metrics.

    Port 0 is a free port, which the `metrics on ...` line names (many agents on one
    host, as in tests and demos)."""
    if value is None:
        return None
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or default_host
    if not (port.isdigit() and 0 <= int(port) < 65536):
        raise UsageError(f"{flag} takes PORT or HOST:PORT with a port within 0..65535 (0: a free one), got {value!r}")
    return MetricsAddress(host, int(port))


@contextlib.contextmanager
def serving(address: MetricsAddress | None, registry: CollectorRegistry) -> Iterator[None]:
    """Serve `registry` on `address` (if any) while the block runs."""
    if address is None:
        yield
        return
    from prometheus_client import disable_created_metrics, start_http_server

    disable_created_metrics()  # no `_created` twin of every counter: Prometheus does not need it
    try:
        server, thread = start_http_server(address.port, addr=address.host, registry=registry)
    except (OSError, ValueError) as e:  # busy port, unknown address
        raise UsageError(f"metrics cannot listen on {address.host}:{address.port}: {e}") from None
    log.info("metrics on %s", MetricsAddress(address.host, server.server_port).url, extra=HEADLINE)
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
