"""bluecached refuses a setting it cannot run with in one line that names the problem, exits 1,
and prints no traceback (issue 16, "Messages")."""

import contextlib
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def start(tmp_path: Path, **settings) -> list[str]:
    """Runs bluecached with a config of `settings` (dotted keys) until it exits, which it must
    do with status 1; returns its ERROR lines (there must be no traceback)."""
    cfg = {"state_dir": str(tmp_path / "state"), "log_level": "info",
           "tiers": {"dram": {"size": "64MiB", "prefault": 0},
                     "nvme": {"path": str(tmp_path / "nvme"), "size": "256MiB",
                              "segment_size": "64MiB"}},
           "metrics": {"listen": ""}}
    for key, value in settings.items():
        node = cfg
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    path = tmp_path / "bluecached.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, "-m", "bluecached.daemon", "--config", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line.split(" ERROR ", 1)[1] for line in r.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, r.stderr
    return errors


def test_a_state_dir_that_is_a_file(tmp_path):
    (tmp_path / "state").write_text("")
    assert start(tmp_path) == [
        f"bluecached: cannot start: state directory {tmp_path / 'state'} is a file, "
        "not a directory"]


def test_a_state_dir_under_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    state = tmp_path / "file" / "state"
    assert start(tmp_path, state_dir=str(state)) == [
        f"bluecached: cannot start: state directory {state} cannot be created: "
        f"{tmp_path / 'file'} is a file, not a directory"]


def test_an_nvme_path_that_is_a_file(tmp_path):
    (tmp_path / "nvme").write_text("")
    assert start(tmp_path) == [
        f"bluecached: cannot start: NVMe directory {tmp_path / 'nvme'} is a file, "
        "not a directory"]


@contextlib.contextmanager
def immutable(path: Path):
    r = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"chattr +i {path}: {r.stderr.strip()} (the test needs root and a "
                    "filesystem with the immutable attribute)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.mark.parametrize("lock_file_there", [False, True], ids=["new", "used-before"])
def test_a_state_dir_that_is_not_writable(tmp_path, lock_file_there):
    """An immutable (or read-only) state directory: named as not writable, whether or not an
    earlier run left its lock file there (the sockets failed next, with a traceback)."""
    state = tmp_path / "state"
    state.mkdir()
    if lock_file_there:
        (state / "bluecached.lock").write_text("")
    with immutable(state):
        (error,) = start(tmp_path)
    assert error.startswith(f"bluecached: cannot start: state directory {state} is not "
                            "writable"), error
    assert "lsattr -d" in error, error


def test_a_state_dir_too_long_for_a_socket(tmp_path):
    state = tmp_path / ("s" * 120)
    (error,) = start(tmp_path, state_dir=str(state))
    assert error.startswith(f"bluecached: cannot start: state directory {state}: the path is "
                            "too long for the daemon's sockets"), error


def test_something_in_the_way_of_a_socket(tmp_path):
    (tmp_path / "state" / "control.sock").mkdir(parents=True)
    assert start(tmp_path) == [
        f"bluecached: cannot start: cannot listen on {tmp_path / 'state' / 'control.sock'}: "
        "a directory of that name is in the way"]


def test_a_metrics_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        listen = f"127.0.0.1:{busy.getsockname()[1]}"
        assert start(tmp_path, **{"metrics.listen": listen}) == [
            f"bluecached: cannot start: metrics endpoint {listen}: cannot listen: "
            "Address already in use"]


def test_nvme_hits_as_clones_where_the_filesystem_checks_nothing(tmp_path):
    """tiers.nvme.hit_path clone lets the kernel read the disk unchecked by bluecached: only
    on a filesystem that checks its data itself (btrfs). tmp_path is not one here."""
    (error,) = start(tmp_path, **{"tiers.nvme.hit_path": "clone"})
    assert error.startswith(f"bluecached: cannot start: tiers.nvme.hit_path clone: "
                            f"{tmp_path / 'nvme'}: not btrfs: the filesystem keeps no "
                            "checksums of file data; use direct")
