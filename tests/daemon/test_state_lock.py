"""One bluecached per state directory: a second daemon on a directory in use refuses to start
(it used to take the sockets over, and its checkpoint at stop deleted the journal the first
was still writing, so files written afterwards were lost in a crash)."""

import pytest

from support import FileClient, MiB, pattern, wait_settled

IN_USE = "is in use by bluecached pid"


def _refused(second) -> str:
    """Starts `second`, which must exit before READY=1; returns its log."""
    with pytest.raises(RuntimeError) as e:
        second.start()
    assert "exited with" in str(e.value), str(e.value)   # not "did not send READY=1"
    assert second.proc.returncode == 1
    log = second.log_text()
    assert "Traceback" not in log, log
    return log


def test_second_daemon_on_a_state_dir_in_use_refuses_and_the_first_keeps_its_files(daemon):
    first = daemon().start()
    nvme = first.root / "nvme"
    second = daemon(allow_log=[IN_USE], **{"state_dir": str(first.state_dir),
                                           "tiers.nvme.path": str(nvme)})
    log = _refused(second)
    problems = [line for line in log.splitlines() if " ERROR " in line]
    assert problems == [f"{problems[0].split(' ERROR ')[0]} ERROR bluecached: cannot start: "
                        f"state directory {first.state_dir} {IN_USE} {first.proc.pid}"], log

    # The first daemon still owns its sockets and its journal: what it stores after the
    # refused start survives a crash.
    fc = FileClient(first)
    blobs = {f"/after/{i}.bin": pattern(f"lock{i}", 2 * MiB + i) for i in range(4)}
    for path, data in blobs.items():
        fc.put(path, data, tmp_suffix=".tmp")
    fc.close()
    wait_settled(first)
    first.kill()
    first.start()     # the lock died with the killed process: the same directory starts again
    fc = FileClient(first)
    for path, data in blobs.items():
        assert fc.get(path) == data, path
    fc.close()


def test_second_daemon_on_an_nvme_dir_in_use_refuses(daemon):
    first = daemon().start()
    nvme = first.root / "nvme"
    second = daemon(allow_log=[IN_USE], **{"tiers.nvme.path": str(nvme)})   # own state dir
    log = _refused(second)
    assert f"NVMe directory {nvme} {IN_USE} {first.proc.pid}" in log, log
    assert not (second.state_dir / "control.sock").exists()    # refused before binding
    fc = FileClient(first)
    fc.put("/still/served.bin", b"ok")
    assert fc.get("/still/served.bin") == b"ok"
    fc.close()
