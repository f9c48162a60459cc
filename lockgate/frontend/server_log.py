"""The server's log, as Triton's logging extension changes it at run time (`/v2/logging`,
gRPC `LogSettings`; the settings are `protocol/log_settings.py`'s).

- log_info, log_warning, log_error: a filter on the log's handlers (those of the root logger
  and of `lockgate.access`, set up by the CLI) drops the records of a level turned off,
  whichever logger wrote them. The access log's lines are INFO records: log_info false stops
  them too.
- log_verbose_level: above 0, lockgate's loggers (`lockgate.*`) write their DEBUG records
  (what `-v` turns on at start-up); at 0 they write from INFO up.
- log_format: ISO8601 stamps each line of the root handlers with its UTC time as
  2026-01-31T12:00:00.123Z; default keeps the CLI's format. The access log's JSON lines carry
  their own `time` and are left as they are.
"""

from __future__ import annotations

import logging
import time

from lockgate.protocol.log_settings import LogSettings

LOGGER = "lockgate"  # the loggers whose DEBUG records log_verbose_level turns on
ACCESS = "lockgate.access"


class LevelFilter(logging.Filter):
    """Drops the records of the levels the settings turn off."""

    def __init__(self, settings: LogSettings) -> None:
        super().__init__()
        self.settings = settings

    def filter(self, record: logging.LogRecord) -> bool:
        level, settings = record.levelno, self.settings
        if level >= logging.ERROR:
            return settings.log_error
        if level >= logging.WARNING:
            return settings.log_warning
        if level >= logging.INFO:
            return settings.log_info
        return True  # DEBUG: the loggers' level decides (log_verbose_level)


class Iso8601Formatter(logging.Formatter):
    """A formatter whose time stamps are ISO 8601, in UTC, to the millisecond."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{stamp}.{int(record.msecs):03d}Z"


class ServerLog:
    """The settings the process logs by, applied to Python's logging."""

    def __init__(self, settings: LogSettings | None = None) -> None:
        self.settings = settings or LogSettings()
        self.filter = LevelFilter(self.settings)
        self.formats: dict[logging.Handler, logging.Formatter | None] = {}

    def install(self) -> None:
        """Take over the process's handlers (once logging is set up): the filter on each,
        and the verbose level `-v` chose as the start."""
        for handler in logging.getLogger().handlers:
            handler.addFilter(self.filter)
            self.formats[handler] = handler.formatter
        for handler in logging.getLogger(ACCESS).handlers:
            handler.addFilter(self.filter)
        verbose = logging.getLogger(LOGGER).isEnabledFor(logging.DEBUG)
        self.apply(LogSettings(log_verbose_level=int(verbose)))

    def apply(self, settings: LogSettings) -> None:
        self.settings = self.filter.settings = settings
        logging.getLogger(LOGGER).setLevel(logging.DEBUG if settings.verbose else logging.INFO)
        for handler, original in self.formats.items():
            if settings.log_format == "ISO8601":
                fmt = original._fmt if original is not None else None
                handler.setFormatter(Iso8601Formatter(fmt))
            else:
                handler.setFormatter(original)
