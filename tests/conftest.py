import pytest

from support import Harness


@pytest.fixture
def harness(tmp_path):
    made = []

    def make(**kw):
        h = Harness(tmp_path / f"h{len(made)}", **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


@pytest.fixture
def daemon(tmp_path):
    """Factory of real bluecached processes; all are stopped at the end, and a test fails if
    a daemon logged a warning or error it did not declare with `allow_log`."""
    from support import DaemonProcess

    made = []

    def make(allow_log=(), **settings):
        d = DaemonProcess(tmp_path / f"d{len(made)}", **settings)
        d.allowed_log = list(allow_log)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop(timeout=30)
    for d in made:
        if d.log.exists():
            bad = d.unexpected_log_lines(d.allowed_log)
            assert not bad, "unexpected warnings in bluecached's log:\n" + "\n".join(bad)
