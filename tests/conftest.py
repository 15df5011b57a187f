import shutil

import pytest

from support import Harness, ScratchBtrfs

LOG_TAIL_LINES = 150   # of each daemon's log, in the report of a test that failed
DAEMON_LOGS = pytest.StashKey[list]()   # the log files of the daemons a test started


def _daemon_logs(item) -> list:
    return item.stash.setdefault(DAEMON_LOGS, [])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed shows the end of each daemon's log beside its traceback: a flaky
    failure in CI is then understood from its one report (was an EIO the kernel's or
    hostd's?)."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for log in _daemon_logs(item):
        if log.exists():
            tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            report.sections.append((f"daemon log {log}", "\n".join(tail)))


@pytest.fixture
def shmem_policy_kept():
    """The machine's shmem huge page policy, put back afterwards (the daemons raise it, and
    some tests set it): yields the policy found."""
    from bluecached import huge_pages
    before = huge_pages.shmem_policy()
    if before is None:
        pytest.skip("no shmem huge page policy on this kernel")
    yield before
    huge_pages.SHMEM_ENABLED.write_text(f"{before}\n")


@pytest.fixture
def shmem_never(shmem_policy_kept):
    """shmem policy `never` (4 KiB pages for memfds) for the test, the machine's afterwards."""
    from bluecached import huge_pages
    if shmem_policy_kept not in ("never", "advise", "within_size", "always"):
        pytest.skip(f"the kernel's shmem huge page policy is {shmem_policy_kept}")
    huge_pages.SHMEM_ENABLED.write_text("never\n")


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
def engine():
    """The DMA engine the daemons of a test run: loopback, except where a directory's conftest
    parametrizes it (tests/mount runs once with each engine)."""
    return "loopback"


@pytest.fixture
def daemon(request, tmp_path, engine):
    """Factory of real bluecached processes; all are stopped at the end, and a test fails if
    a daemon logged a warning or error it did not declare with `allow_log`."""
    from support import DaemonProcess, engine_settings

    made = []

    def make(allow_log=(), **settings):
        d = DaemonProcess(tmp_path / f"d{len(made)}",
                          **{**engine_settings(engine)["bluecached"], **settings})
        d.allowed_log = list(allow_log)
        made.append(d)
        _daemon_logs(request.node).append(d.log)
        return d

    yield make
    for d in made:
        d.stop(timeout=30)
    for d in made:
        if d.log.exists():
            bad = d.unexpected_log_lines(d.allowed_log)
            assert not bad, "unexpected warnings in bluecached's log:\n" + "\n".join(bad)


class Stack:
    """bluecached + hostd as separate processes, the cache mounted at `mnt`."""

    def __init__(self, daemon, hostd, mnt):
        self.daemon, self.hostd, self.mnt = daemon, hostd, mnt

    def path(self, rel: str):
        return self.mnt / rel.lstrip("/")


@pytest.fixture
def mounted(request, tmp_path, daemon, engine):
    """Factory: start a real bluecached and a real hostd mounting a temp dir. Each stack is
    torn down (unmounted) at the end, and unexpected warnings in either log fail the test."""
    from support import HostdProcess, engine_settings, force_unmount

    stacks = []

    def make(allow_log=(), hostd_settings=None, **settings):
        d = daemon(allow_log=allow_log, **settings).start()
        mnt = tmp_path / f"mnt{len(stacks)}"
        h = HostdProcess(d, mnt, **{**engine_settings(engine)["hostd"],
                                    **(hostd_settings or {})}).start()
        h.allowed_log = list(allow_log)
        _daemon_logs(request.node).append(h.log)
        stack = Stack(d, h, mnt)
        stacks.append(stack)
        return stack

    yield make
    for s in stacks:
        s.hostd.stop(timeout=30)
        force_unmount(s.mnt)
    for s in stacks:
        bad = s.hostd.unexpected_log_lines(s.hostd.allowed_log)
        assert not bad, "unexpected warnings in hostd's log:\n" + "\n".join(bad)


@pytest.fixture(scope="session")
def ceph(tmp_path_factory):
    """One real single-node Ceph cluster (mon, mgr, OSD, radosgw) for the session's remote-tier
    tests; stopped, every daemon, when the session ends."""
    from ceph_cluster import CephCluster, available

    problem = available()
    if problem:
        pytest.fail(f"the remote tier's tests need Ceph: {problem}")
    cluster = CephCluster(tmp_path_factory.mktemp("ceph"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def bucket(ceph, tmp_path):
    """A fresh bucket on the cluster and a credentials file for it: (name, path)."""
    import uuid

    name = f"bc-{uuid.uuid4().hex[:16]}"
    if ceph.rgw is None:   # a test that killed radosgw failed before restarting it
        ceph.start_rgw()
    ceph.s3_client().create_bucket(Bucket=name)
    creds = ceph.write_credentials(tmp_path / "s3-credentials")
    return name, creds


@pytest.fixture
def btrfs(tmp_path):
    """A scratch btrfs on a loop device (support.ScratchBtrfs). Ask for it before the daemons
    that use it, so that it goes after them."""
    if shutil.which("mkfs.btrfs") is None:
        pytest.skip("mkfs.btrfs is not installed (btrfs-progs: scripts/setup.sh --test)")
    fs = ScratchBtrfs(tmp_path / "btrfs")
    yield fs
    fs.close()
