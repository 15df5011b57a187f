"""What hostd makes of pyfuse3's log."""

import errno
import logging
import os

_ENOENT = os.strerror(errno.ENOENT)


def answer_to_a_gone_connection(record: logging.LogRecord) -> bool:
    """pyfuse3 logs an error when /dev/fuse refuses an answer. ENOENT means the kernel holds no
    such request any more: the connection ended (an unmount) after the request was read and
    before it was answered. It can happen whenever hostd unmounts (the kernel does not wait for
    the answers to RELEASE, and the fuse shim's reader thread reads requests ahead; seen at a
    test's unmount), and
    nothing is lost: the request's work was done, only its answer has no one to go to. Such a
    record is kept at DEBUG; any other refused answer stays an error."""
    if (record.levelno == logging.ERROR and isinstance(record.msg, str)
            and "fuse_reply_* failed" in record.msg and record.args == (_ENOENT,)):
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger("pyfuse3").isEnabledFor(logging.DEBUG)
    return True
