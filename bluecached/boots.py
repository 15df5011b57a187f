"""The boot counter in the state directory: every run of bluecached on it gets a greater one.

Inode numbers carry the boot (`boot << index.INO_BOOT_SHIFT`), and a client's kernel keeps
the numbers it was given across a restart of the daemon (hostd's mount stays). A number the
new run handed out again would name another file: a name the kernel still holds would read
that file's bytes. The NVMe tier's journal records the boot too, but there is no journal
without the NVMe tier, or once its directory was wiped or moved; the state directory always
exists (it holds the daemon's lock and sockets). So the boot is kept here as well, and a run
takes one past the greater of the two.
"""

import logging
import os
from pathlib import Path

from .paths import fsync_directory

log = logging.getLogger(__name__)

FILE_NAME = "boot"


def last_boot(state_dir: Path) -> int:
    """The boot of the last run on `state_dir` (0: none recorded). A file that does not hold
    a number is a problem for the log, not for the start: the journal's boot still counts,
    and the run after this one records a good one again."""
    path = Path(state_dir) / FILE_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    try:
        boot = int(text.strip())
    except ValueError:
        boot = -1
    if boot < 0:
        log.warning("%s does not hold a boot number (%r): ignored; inode numbers of this run "
                    "may repeat those of a run before it", path, text[:40])
        return 0
    return boot


def record_boot(state_dir: Path, boot: int) -> None:
    """Records `boot` before the run hands out any inode number: written whole and synced,
    so a crash leaves the old number or the new one, never a torn file."""
    path = Path(state_dir) / FILE_NAME
    tmp = path.with_name(FILE_NAME + ".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, f"{boot}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_directory(path.parent)
