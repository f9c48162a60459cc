"""Incremental server-sent-events parsing: bytes in any chunking, `data:` payloads out."""

from __future__ import annotations

import codecs


class SSEDecoder:
    """Feed raw bytes as they arrive; get the data of each completed event.

    Lines and UTF-8 characters may be split across chunks; lines may end in LF, CRLF or CR.
    An event ends at a blank line; several `data:` lines in one event are joined with
    newlines. Comments (lines that start with ':') and the other fields (event, id, retry)
    are skipped.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._data: list[str] = []
        self._pending_cr = False
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, chunk: bytes) -> list[str]:
        text = self._utf8.decode(chunk)  # keeps a character split across chunks
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]  # the LF of a CRLF split across chunks
        self._pending_cr = text.endswith("\r")
        self._buffer += text.replace("\r\n", "\n").replace("\r", "\n")
        events: list[str] = []
        *lines, self._buffer = self._buffer.split("\n")
        for line in lines:
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def flush(self) -> list[str]:
        """At end of stream: the last event, if the server did not end it with a blank line."""
        events = self.feed(b"\n") if self._buffer else []
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _line(self, line: str) -> str | None:
        if not line:
            if not self._data:
                return None
            event, self._data = "\n".join(self._data), []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None
