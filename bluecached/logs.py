"""Both daemons' log lines on stderr: plain lines (with a timestamp outside systemd) on a
terminal or in a file, and lines with syslog priority prefixes (`<4>` for a warning) when
stderr is the journal, so that `journalctl -p warning` shows warnings and errors only.

systemd says stderr is the journal by setting JOURNAL_STREAM to the device and inode of the
stream it connected ("DEV:INO"); a daemon whose stderr was redirected elsewhere (a file, a
pipe to `bluecachectl up` run by hand) inherits the variable but not the stream, so the match
is what counts, not the variable alone. journald reads a `<N>` at the start of each line as
that line's priority (SyslogLevelPrefix=yes, its default).
"""

import logging
import os
import sys
from typing import TextIO

# logging's levels -> syslog priorities (RFC 5424: 2 crit, 3 err, 4 warning, 6 info, 7 debug).
_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4),
               (logging.INFO, 6))
DEBUG_PRIORITY = 7


def priority(levelno: int) -> int:
    """The syslog priority of a logging level (levels between two take the lower one's)."""
    for level, prio in _PRIORITIES:
        if levelno >= level:
            return prio
    return DEBUG_PRIORITY


def stream_is_journal(stream: TextIO, environ=os.environ) -> bool:
    """Whether `stream` is the journal stream systemd named in JOURNAL_STREAM."""
    dev, colon, ino = environ.get("JOURNAL_STREAM", "").partition(":")
    if not colon:
        return False
    try:
        st = os.fstat(stream.fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (ValueError, OSError, AttributeError):   # no fd (a StringIO), or a bad variable
        return False


class PriorityFormatter(logging.Formatter):
    """Each line of a record (a traceback's too) starts with the record's `<N>`: journald
    takes every line as an entry of its own."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


def formatter(stream: TextIO, environ=os.environ) -> logging.Formatter:
    """The formatter for a daemon logging to `stream`: priorities for the journal; no
    timestamp under systemd (the journal stamps each line itself)."""
    journal = stream_is_journal(stream, environ)
    under_systemd = journal or "INVOCATION_ID" in environ
    fmt = "%(levelname)s %(name)s: %(message)s" if under_systemd else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    return PriorityFormatter(fmt) if journal else logging.Formatter(fmt)


def setup(level: str, stream: TextIO | None = None) -> None:
    """Sends the process's log records at `level` ("info", ...) and above to `stream`
    (stderr), formatted as `formatter` says."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(handler.stream))
    logging.basicConfig(level=level.upper(), handlers=[handler])
