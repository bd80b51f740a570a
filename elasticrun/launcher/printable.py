"""Text from the store made safe for a terminal.

What `status` and `stacks` print comes partly from workers: their stacks (function
and file names, source lines), their error messages, a health check's last line. A
worker may put terminal escape sequences in them (a forged stack dump), which would
move the cursor, rewrite what the operator sees, or set the window's title. Each
character that is not printable is shown escaped (`\\x1b`), never sent raw; newlines and
tabs, the page's own layout, stay.
"""

from __future__ import annotations

_LAYOUT = "\n\t"


def shown(text: str) -> str:
    """`text` with every non-printable character but a newline or a tab escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in _LAYOUT else _escaped(c) for c in text)


def _escaped(c: str) -> str:
    return repr(c)[1:-1] if c != "'" else c
