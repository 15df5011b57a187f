"""hostd/fuse_log.py: an answer the kernel no longer waits for is not an error."""

import errno
import logging
import os

import pytest

from hostd.fuse_log import answer_to_a_gone_connection


def pyfuse3_record(msg, *args, level=logging.ERROR):
    return logging.LogRecord("pyfuse3", level, "handlers.pxi", 1, msg, args, None)


@pytest.mark.parametrize("debug", [False, True])
def test_an_answer_to_a_request_the_kernel_forgot_goes_to_debug(debug):
    logger = logging.getLogger("pyfuse3")
    old = logger.level
    logger.setLevel(logging.DEBUG if debug else logging.INFO)
    try:
        r = pyfuse3_record("fuse_release(): fuse_reply_* failed with %s",
                           os.strerror(errno.ENOENT))
        assert answer_to_a_gone_connection(r) is debug
        assert r.levelno == logging.DEBUG and r.levelname == "DEBUG"
    finally:
        logger.setLevel(old)


@pytest.mark.parametrize("record", [
    pyfuse3_record("fuse_write(): fuse_reply_* failed with %s", os.strerror(errno.EINVAL)),
    pyfuse3_record("fuse_read(): fuse_reply_* failed with %s", os.strerror(errno.ENODEV)),
    pyfuse3_record("something else: %s", os.strerror(errno.ENOENT)),
    pyfuse3_record("fuse_release(): fuse_reply_* failed with %s", os.strerror(errno.ENOENT),
                   level=logging.WARNING),
])
def test_every_other_record_passes_unchanged(record):
    level = record.levelno
    assert answer_to_a_gone_connection(record) is True
    assert record.levelno == level


def test_hostd_main_installs_the_filter(tmp_path):
    """hostd's main() wires the filter into pyfuse3's logger: a gone connection's record stays
    out of its log, another refused answer stays in (main runs with trio.run stubbed out)."""
    import subprocess
    import sys
    cfg = tmp_path / "hostd.yaml"
    cfg.write_text("{}\n")
    script = f"""
import errno, logging, os, sys
import hostd.daemon as d
def fake_run(*args, **kwargs):
    log = logging.getLogger("pyfuse3")
    log.error("fuse_release(): fuse_reply_* failed with %s", os.strerror(errno.ENOENT))
    log.error("fuse_write(): fuse_reply_* failed with %s", os.strerror(errno.EINVAL))
d.trio.run = fake_run
sys.exit(d.main(["--config", {str(cfg)!r}]))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "fuse_write(): fuse_reply_* failed with " + os.strerror(errno.EINVAL) in r.stderr
    assert os.strerror(errno.ENOENT) not in r.stderr
