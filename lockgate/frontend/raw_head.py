"""A request head's lines read from raw bytes, below the HTTP parser.

The protocol reads two kinds of head itself before the parser sees them: health probes
(`frontend/probe.py`) and POST heads judged on arrival (`frontend/arrival.py`). Both read
their header lines the same way, and leave to the parser any line this reading does not
handle, which then answers it as it would any request.
"""

from __future__ import annotations


def header_line(line: bytes) -> tuple[bytes, bytes] | None:
    """A header line as (its name in lower case, its value without surrounding blanks); None
    when it has no colon or name, a blank before its colon, or starts with a blank (folded)."""
    name, colon, value = line.partition(b":")
    if not colon or not name or name[-1:] in b" \t" or line[:1] in b" \t":
        return None
    return name.lower(), value.strip(b" \t")


def closes(value: bytes) -> bool | None:
    """Whether a `Connection` value asks to close the connection; None for a value other than
    `close` or `keep-alive`."""
    token = value.lower()
    if token == b"close":
        return True
    return False if token == b"keep-alive" else None
