"""hostd and `bluecachectl up` refuse what they cannot run with in one line that names the
problem, exit non-zero, and print no traceback (issue 16, "Messages"). Where a case is not a
problem (a mountpoint whose parents are missing, or on a read-only filesystem) they serve."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support import HostdProcess, force_unmount, is_mounted


@pytest.fixture
def engine():
    """Startup errors do not depend on the DMA engine: loopback only (tests/mount's conftest
    would run each test with both)."""
    return "loopback"


def hostd(tmp_path: Path, mountpoint: Path, state_dir: Path, env=None) -> list[str]:
    """Runs hostd until it exits, which it must do with status 1 and no traceback; returns its
    ERROR lines."""
    config = tmp_path / "hostd-fails.yaml"
    config.write_text(yaml.safe_dump({"mountpoint": str(mountpoint), "state_dir": str(state_dir),
                                      "daemon": {"request_timeout": "1s"}}))
    r = subprocess.run([sys.executable, "-m", "hostd.daemon", "--config", str(config)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line.split(" ERROR ", 1)[1] for line in r.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, r.stderr
    return errors


def _bad_mountpoints(tmp: Path) -> dict[str, tuple[Path, str]]:
    (tmp / "file").write_text("")
    (tmp / "link").symlink_to(tmp / "file")
    (tmp / "dangling").symlink_to(tmp / "nowhere")
    return {
        "file": (tmp / "file", f"mountpoint {tmp / 'file'} is a file, not a directory"),
        "under-a-file": (tmp / "file" / "mnt", f"mountpoint {tmp / 'file' / 'mnt'} cannot be "
                                               f"created: {tmp / 'file'} is a file, not a "
                                               "directory"),
        "symlink-to-a-file": (tmp / "link", f"mountpoint {tmp / 'link'} is a symlink to "
                                            f"{tmp / 'file'}, which is a file, not a directory"),
        "dangling-symlink": (tmp / "dangling", f"mountpoint {tmp / 'dangling'} is a symlink to "
                                               f"{tmp / 'nowhere'}, which does not exist"),
    }


BAD_MOUNTPOINTS = ["file", "under-a-file", "symlink-to-a-file", "dangling-symlink"]


@pytest.mark.parametrize("case", BAD_MOUNTPOINTS)
def test_hostd_names_a_mountpoint_that_cannot_be_a_directory(tmp_path, daemon, case):
    d = daemon().start()
    mountpoint, message = _bad_mountpoints(tmp_path)[case]
    assert hostd(tmp_path, mountpoint, d.state_dir) == [f"hostd: cannot start: {message}"]
    assert not is_mounted(mountpoint)


@pytest.mark.parametrize("case", BAD_MOUNTPOINTS)
def test_up_names_a_mountpoint_that_cannot_be_a_directory_before_starting_anything(tmp_path,
                                                                                     case):
    mountpoint, message = _bad_mountpoints(tmp_path)[case]
    r = up(tmp_path, "--mount", str(mountpoint))
    assert r.returncode == 1
    assert r.stderr == f"bluecachectl up: {message}\n"
    assert not (tmp_path / "state" / "bluecached.yaml").exists()   # nothing was started


def up(tmp_path: Path, *options: str, state: Path | None = None) -> subprocess.CompletedProcess:
    """`up` that must exit before starting anything (a deadline only against a hang)."""
    return subprocess.run([sys.executable, "-m", "bluecached.ctl", "up",
                           "--state-dir", str(state or tmp_path / "state"),
                           "--dram-size", "64MiB", "--nvme-size", "0", "--metrics", "",
                           *options], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def test_hostd_creates_missing_parents_of_the_mountpoint(tmp_path, daemon):
    d = daemon().start()
    mountpoint = tmp_path / "not" / "yet" / "there"
    h = HostdProcess(d, mountpoint).start()
    try:
        assert is_mounted(mountpoint)
    finally:
        assert h.stop() == 0
        force_unmount(mountpoint)


def test_hostd_on_a_symlinked_mountpoint_clears_the_dead_mount_a_crash_left(tmp_path, daemon):
    """The kernel lists the mount at the symlink's target: a restart after SIGKILL looked for
    a stale mount at the symlink, found none, and stopped with '[Errno 17] File exists'."""
    d = daemon().start()
    (tmp_path / "real").mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real")
    h = HostdProcess(d, link).start()
    try:
        h.kill()
        assert is_mounted(tmp_path / "real")          # dead: ENOTCONN
        h.start()
        os.listdir(link)                               # served again
        assert "clearing the mount a crashed hostd left" in h.log.read_text()
    finally:
        h.stop()
        force_unmount(tmp_path / "real")


def test_hostd_mounts_on_a_read_only_filesystem_without_guarding(tmp_path, daemon):
    """The directory under the mount is on a read-only filesystem: nothing can be written there
    anyway, so there is nothing to guard (it said '[Errno 30] Read-only file system')."""
    d = daemon().start()
    source, ro = tmp_path / "source", tmp_path / "ro"
    (source / "mnt").mkdir(parents=True)
    ro.mkdir()
    subprocess.run(["mount", "--bind", "-o", "ro", str(source), str(ro)], check=True)
    h = None
    try:
        h = HostdProcess(d, ro / "mnt").start()
        assert is_mounted(ro / "mnt")
        assert "is on a read-only filesystem" in h.log.read_text()
    finally:
        if h is not None:
            assert h.stop() == 0
        force_unmount(ro / "mnt")
        subprocess.run(["umount", str(ro)], check=True)


def test_hostd_without_bluecached_says_it_is_not_running(tmp_path):
    state = tmp_path / "no-state"
    assert hostd(tmp_path, tmp_path / "mnt", state) == [
        f"hostd: cannot start: bluecached is not running with state directory {state} "
        "(it does not exist; waited 1s)"]


def test_hostd_with_a_socket_left_by_a_stopped_bluecached(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.bind(str(state / "control.seq"))     # bound, never listening: as after a crash
    assert hostd(tmp_path, tmp_path / "mnt", state) == [
        f"hostd: cannot start: bluecached is not running with state directory {state} "
        "(waited 1s; control.seq is left from one that stopped: connection refused)"]


def test_hostd_without_dev_fuse(tmp_path):
    """/dev/fuse missing (module not loaded, a container without the device): a private mount
    namespace whose /dev is an empty tmpfs. hostd says so before it touches anything."""
    if shutil.which("unshare") is None:
        pytest.fail("the test needs unshare (util-linux)")
    config = tmp_path / "hostd.yaml"
    mountpoint = tmp_path / "mnt"
    config.write_text(yaml.safe_dump({"mountpoint": str(mountpoint),
                                      "state_dir": str(tmp_path / "state")}))
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs none /dev && exec "$0" -m hostd.daemon --config "$1"',
         sys.executable, str(config)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line.split(" ERROR ", 1)[1] for line in r.stderr.splitlines() if " ERROR " in line]
    assert errors == [f"hostd: cannot start: cannot mount {mountpoint}: /dev/fuse does not "
                      "exist: load the fuse kernel module (modprobe fuse), or in a container, "
                      "pass the device in"], r.stderr
    assert not mountpoint.exists()


@pytest.mark.parametrize("where", ["state-dir-is-a-file", "under-a-file"])
def test_up_names_a_state_dir_that_cannot_be_a_directory(tmp_path, where):
    (tmp_path / "file").write_text("")
    state = tmp_path / "file" if where == "state-dir-is-a-file" else tmp_path / "file" / "s"
    r = up(tmp_path, "--mount", str(tmp_path / "mnt"), state=state)
    assert r.returncode == 1
    expected = (f"state directory {state} is a file, not a directory" if state.name == "file"
                else f"state directory {state} cannot be created: {tmp_path / 'file'} is a "
                     "file, not a directory")
    assert r.stderr == f"bluecachectl up: {expected}\n"


def test_up_on_a_state_dir_in_use_leaves_the_running_one_alone(tmp_path):
    """A second `up` on the state directory of a running one refused only once bluecached did,
    after it had overwritten the running daemons' configs (and notify sockets) there."""
    from bluecached.statelock import DirLock

    state = tmp_path / "state"
    state.mkdir()
    (state / "hostd.yaml").write_text("the running up's\n")
    lock = DirLock(state, "state directory").acquire()    # as a running bluecached holds it
    try:
        r = up(tmp_path, "--mount", str(tmp_path / "mnt"))
    finally:
        lock.release()
    assert r.returncode == 1
    assert r.stderr == (f"bluecachectl up: state directory {state} is in use by bluecached "
                        f"pid {os.getpid()}\n")
    assert (state / "hostd.yaml").read_text() == "the running up's\n"
    assert not (state / "bluecached.yaml").exists()


@pytest.mark.parametrize("option, value", [("--dram-size", "lots"), ("--nvme-size", "-1"),
                                           ("--metrics", "nowhere")])
def test_up_names_the_option_with_a_bad_value(tmp_path, option, value):
    r = up(tmp_path, "--mount", str(tmp_path / "mnt"), f"{option}={value}")
    assert r.returncode == 2
    assert r.stderr.startswith(f"bluecachectl up: {option}: expected "), r.stderr
    assert repr(value) in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "state").exists()      # checked before anything was created

