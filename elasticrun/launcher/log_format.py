"""How the launcher's own log lines look: text for people, JSON lines for log pipelines.

Text lines carry an ISO 8601 date-time with its zone and the node id,

    [elasticrun 2026-11-24T04:30:01.123+00:00 INFO host_4242] node host_4242 leads job 'job42'

and `--log-format=json` (or ELASTICRUN_LOG_FORMAT=json) writes one object a line with
`time`, `level`, `logger`, `node` and `message` (plus `error`, a traceback, when one is
logged). A dozen lines of `logging.Formatter` rather than a JSON-logging library: the
fields are fixed and few, and the launcher stays at its four dependencies.
Only the agent's own lines change; the workers' output is passed on as it comes.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

FORMATS = ("text", "json")
#: the default of --log-format (and the format of every subcommand's lines)
ENV = "ELASTICRUN_LOG_FORMAT"


class LineFormatter(logging.Formatter):
    """One record, one line: text or JSON, tagged with this node's id once it is known."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.node = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        at = datetime.datetime.fromtimestamp(record.created).astimezone()
        return at.isoformat(timespec="milliseconds")

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        error = self.formatException(record.exc_info) if record.exc_info else ""
        if self.form == "json":
            line: dict[str, str] = {
                "time": self.formatTime(record),
                "level": record.levelname,
                "logger": record.name,
                "node": self.node,
                "message": message,
            }
            if error:
                line["error"] = error
            return json.dumps(line)
        node = f" {self.node}" if self.node else ""
        text = f"[elasticrun {self.formatTime(record)} {record.levelname}{node}] {message}"
        return f"{text}\n{error}" if error else text


_formatter = LineFormatter("text")


def default_format() -> str:
    """ELASTICRUN_LOG_FORMAT when it names a format, else text."""
    value = os.environ.get(ENV, "text").strip().lower()
    return value if value in FORMATS else "text"


def setup_logging() -> None:
    """Lines to stderr at $LOGLEVEL (INFO), in the format ELASTICRUN_LOG_FORMAT names."""
    level = os.environ.get("LOGLEVEL", "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    _formatter.form = default_format()
    handler.setFormatter(_formatter)
    logging.basicConfig(level=level if level in logging.getLevelNamesMapping() else "INFO", handlers=[handler])


def use(form: str) -> None:
    """Switch the format: a flag chose it."""
    _formatter.form = form


def tag(node_id: str) -> None:
    """Tag every line from now on with this node's id."""
    _formatter.node = node_id
