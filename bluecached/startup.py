"""How both daemons run their trio main: problems the operator must fix end the start in one
logged line and exit status 1, Ctrl-C in 130, anything else in a traceback (a bug)."""

import logging

import trio


class StartupError(Exception):
    """A problem the operator must fix; logged as one line, no traceback."""


def run_service(main, *args, log: logging.Logger) -> int:
    """trio.run(main, *args) with strict exception groups (Debian's trio 0.22 defaults to
    loose ones); the process's exit status."""
    status = 0
    try:
        trio.run(main, *args, strict_exception_groups=True)
    except* StartupError as group:
        for e in group.exceptions:
            log.error("cannot start: %s", e)
        status = 1
    except* KeyboardInterrupt:
        status = 130
    return status
