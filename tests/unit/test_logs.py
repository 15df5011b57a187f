"""Both daemons' log lines: syslog priority prefixes when stderr is the journal (JOURNAL_STREAM
names stderr's device and inode), plain lines otherwise."""

import io
import logging
import os

import pytest

from bluecached import logs


def _record(level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord("hostd", level, __file__, 1, message, None, None)


@pytest.mark.parametrize("level,prefix", [
    (logging.DEBUG, "<7>"), (logging.INFO, "<6>"), (logging.WARNING, "<4>"),
    (logging.ERROR, "<3>"), (logging.CRITICAL, "<2>"), (logging.WARNING + 5, "<4>"),
])
def test_each_level_gets_its_syslog_priority(level, prefix):
    line = logs.PriorityFormatter("%(levelname)s %(name)s: %(message)s").format(
        _record(level, "hello"))
    assert line.startswith(prefix) and line.endswith("hostd: hello")


def test_every_line_of_a_record_carries_the_prefix():
    # journald takes each line as an entry: a traceback's lines keep the record's priority
    text = logs.PriorityFormatter("%(message)s").format(_record(logging.ERROR, "one\ntwo"))
    assert text == "<3>one\n<3>two"


def _journal_env(stream) -> dict:
    st = os.fstat(stream.fileno())
    return {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}


def test_prefixes_only_when_stderr_is_the_named_journal_stream(tmp_path):
    with open(tmp_path / "journal", "w") as journal, open(tmp_path / "other", "w") as other:
        env = _journal_env(journal)
        assert logs.stream_is_journal(journal, env)
        # the variable is inherited by a child whose stderr went elsewhere: no prefixes there
        assert not logs.stream_is_journal(other, env)
        assert isinstance(logs.formatter(journal, env), logs.PriorityFormatter)
        assert not isinstance(logs.formatter(other, env), logs.PriorityFormatter)
        # no timestamp under systemd: the journal stamps lines itself
        plain = logs.formatter(other, {"INVOCATION_ID": "x"}).format(
            _record(logging.WARNING, "w"))
        assert plain == "WARNING hostd: w"
    for env in ({}, {"JOURNAL_STREAM": "garbage"}, {"JOURNAL_STREAM": "1:x"}):
        assert not logs.stream_is_journal(io.StringIO(), env)
    assert not logs.stream_is_journal(io.StringIO(), {"JOURNAL_STREAM": "1:2"})


def test_a_daemon_logs_warnings_with_their_priority_to_the_journal(tmp_path):
    """The daemons' own setup: a warning from a process whose stderr is the journal."""
    import subprocess
    import sys
    out = tmp_path / "stderr"
    code = ("import logging; from bluecached import logs; logs.setup('info'); "
            "logging.getLogger('bluecached').warning('disk %s', 'full'); "
            "logging.getLogger('x').debug('hidden')")
    with open(out, "w") as f:
        env = dict(os.environ, **_journal_env(f))
        subprocess.run([sys.executable, "-c", code], stderr=f, env=env, check=True, timeout=60)
    assert out.read_text() == "<4>WARNING bluecached: disk full\n"
    with open(out, "w") as f:   # stderr is not the journal: a plain line with a timestamp
        env = {k: v for k, v in os.environ.items()
               if k not in ("JOURNAL_STREAM", "INVOCATION_ID")}
        subprocess.run([sys.executable, "-c", code], stderr=f, env=env, check=True, timeout=60)
    line = out.read_text()
    assert not line.startswith("<") and line.endswith(" WARNING bluecached: disk full\n")
