"""Prometheus metrics of the built-in store server (`store serve --metrics-port`).

A call costs the server one labelled counter increment when it ends (a lock held for
a microsecond); everything else is read when Prometheus scrapes, in the metrics
server's own thread, from sizes the server and its engine keep anyway (`StoreLoad`,
the calls and watches in progress): no request ever waits for a scrape, nor a scrape
for the event loop. Every metric is listed in docs/deployment.md ("Metrics").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from elasticrun.store.server.memory import StoreLoad


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """What the server holds at one moment, besides its engine's load."""

    connections: int
    calls: int
    watches: int
    engine: StoreLoad


class StoreMetrics:
    """The store's metrics, in `registry` once `serving` is called by the server it watches.

    Not before: an agent made ready to host the store (`--metrics-port`) that finds
    another host's endpoint exports no store metric at all."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.calls = Counter(
            "elasticrun_store_calls",
            "Calls the store answered, by service, method and gRPC status code (OK, NOT_FOUND, ...)",
            ["service", "method", "code"], registry=None,
        )
        self._load: Callable[[], ServerLoad] | None = None

    def serving(self, load: Callable[[], ServerLoad]) -> None:
        """Read the server's load from `load` at each scrape (a thread-safe read), from now on."""
        self._load = load
        self.registry.register(self.calls)
        self.registry.register(_LoadCollector(self))

    def load(self) -> ServerLoad | None:
        return self._load() if self._load is not None else None


class _LoadCollector(Collector):
    def __init__(self, metrics: StoreMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        load = self._metrics.load()
        if load is None:
            return
        e = load.engine
        for name, text, value in (
            ("elasticrun_store_connections", "Client connections with a call in progress", load.connections),
            ("elasticrun_store_calls_in_progress", "Calls in progress (watches and waits included)", load.calls),
            ("elasticrun_store_watchers", "Open watch streams", load.watches),
            ("elasticrun_store_leases", "Live leases", e.leases),
            ("elasticrun_store_keys", "Keys held", e.keys),
            ("elasticrun_store_key_bytes", "Bytes of the keys held (UTF-8)", e.key_bytes),
            ("elasticrun_store_value_bytes", "Bytes of the values held", e.value_bytes),
            ("elasticrun_store_history_revisions", "Revisions kept in the watch history", e.history_revisions),
            ("elasticrun_store_history_bytes", "Bytes of the watch history", e.history_bytes),
            ("elasticrun_store_revision", "The store's revision (that of its latest write)", e.revision),
        ):
            yield GaugeMetricFamily(name, text, value=value)
