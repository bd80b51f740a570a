"""Which of elasticrun's own INFO lines a user sees by default: the headlines.

A job that goes well should say little, as torchrun's does: by default (LOGLEVEL unset)
the launcher shows warnings, errors, and the INFO lines logged with `extra=HEADLINE` —
what a user reads at 3 a.m.: the workers started in a round, stopped (and why), the
job's end, a wait that lasts, where a store or metrics serve. Every other INFO line
(waits that end at once, the leader's decisions, where the logs go) shows with
`LOGLEVEL=INFO`, as torchrun's agent shows its INFO lines; `LOGLEVEL=WARNING` shows
warnings and errors only, which is torchrun's default.

A module of its own, below every layer: the agent, the rendezvous and the launcher
mark their lines, and only the launcher decides what is shown.
"""

from __future__ import annotations

import logging

#: `logger.info(..., extra=HEADLINE)`: shown at the default level
HEADLINE = {"headline": True}


def is_headline(record: logging.LogRecord) -> bool:
    """Whether `record` was logged with `extra=HEADLINE`."""
    return bool(getattr(record, "headline", False))
