"""How the launcher's own log lines look: text for people, JSON lines for log pipelines.

Text lines carry an ISO 8601 date-time with its zone and the node id,

    [elasticrun 2026-11-24T04:30:01.123+00:00 INFO host_4242] node host_4242 leads job 'job42'

and `--log-format=json` (or ELASTICRUN_LOG_FORMAT=json) writes one object a line with
`time`, `level`, `logger`, `node` and `message` (plus `error`, a traceback, when one is
logged). A dozen lines of `logging.Formatter` rather than a JSON-logging library: the
fields are fixed and few, and the launcher stays at its four dependencies.
In JSON the workers' console lines are objects too (elasticrun.agent.output), so that
a pipeline reads every line of both streams; their log files keep the bytes as written.
Which lines show by default is elasticrun.loglines' matter (LOGLEVEL changes it).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

from elasticrun.loglines import is_headline

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
    """Lines to stderr, in the format ELASTICRUN_LOG_FORMAT names, at $LOGLEVEL.

    When it names no level, quiet: warnings, errors and the headlines
    (elasticrun.loglines).

    torchrun's LOGLEVEL works the same way (INFO: every INFO line, WARNING: what
    torchrun shows by default); only the default differs, a few lines a job.
    """
    level = os.environ.get("LOGLEVEL", "").strip().upper()
    handler = logging.StreamHandler(sys.stderr)
    _formatter.form = default_format()
    handler.setFormatter(_formatter)
    if level not in logging.getLevelNamesMapping():
        level = "INFO"
        handler.addFilter(_headlines_and_worse)
    logging.basicConfig(level=level, handlers=[handler])


def _headlines_and_worse(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or is_headline(record)


def line(level: int, message: str, logger: str = "elasticrun") -> str:
    """`message` as a line in the chosen format, for a line printed rather than logged.

    A line printed goes to stdout, or must show whatever the level."""
    record = logging.makeLogRecord(
        {"name": logger, "levelno": level, "levelname": logging.getLevelName(level), "msg": message}
    )
    return _formatter.format(record)


def error_line(message: str) -> str:
    """The CLI's last line when a command fails, in the chosen format.

    Text keeps the `elasticrun: error: ...` that scripts and people grep for; JSON is
    one object like every other line, so a log pipeline never meets a stray text line."""
    if _formatter.form != "json":
        return f"elasticrun: error: {message}"
    return line(logging.ERROR, message)


def use(form: str) -> None:
    """Switch the format: a flag chose it."""
    _formatter.form = form


def tag(node_id: str) -> None:
    """Tag every line from now on with this node's id."""
    _formatter.node = node_id
