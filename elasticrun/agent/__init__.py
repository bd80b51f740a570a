"""Per-node agent: rendezvous loop, worker group supervision, logs, failure reports."""
