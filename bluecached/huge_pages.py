"""2 MiB pages for shared memory that is read and written whole: hostd's staging region
(`mount.huge_pages`) and the DRAM tier's objects (`tiers.dram.huge_pages`).

How fast memory is copied or read into on the Firecracker VM the benchmarks run on depends on
how it lies, not only on its amount:
- 32 MiB read from NVMe as 8 x 4 MiB O_DIRECT reads took 13.1 ms into a memfd of 4 KiB pages
  and 9.1 ms into the same on 2 MiB pages (bench/staging_pages.py, 3 runs,
  docs/benchmarks/staging-pages.md; probes saw 4 KiB pages as slow as 17.3 ms);
- a 32 MiB memfd of 4 KiB pages was read in 2.4 to 5.0 ms depending on which pages it got
  (steady for each file, 48 files), written in ~4.2 ms with its pages allocated before and
  ~11 ms without (as a store allocates them); on 2 MiB pages read in ~2.0 ms and written in
  ~2.2 ms either way (ad hoc, 10-12 files each, docs/benchmarks/hit-notes.md).
Why was not measured (the likely reason: fewer translations per byte, in the guest and in the
hypervisor's tables below it); on a host without a hypervisor it may matter less, and a
2 MiB page costs nothing more for memory that is used whole.

A memfd gets 2 MiB pages only where the kernel's shmem policy allows them:
/sys/kernel/mm/transparent_hugepage/shmem_enabled; Debian and many distributions boot with
`never`. Two policies serve here:
- `advise`: huge pages for mappings that ask with madvise(MADV_HUGEPAGE), nothing else
  changes (`allow_advised`, hostd's staging). Pages come as 2 MiB only when they are first
  allocated through such a mapping: `populate_huge` allocates them all at once, so no later
  write(2), fallocate or O_DIRECT read allocates a 4 KiB one in their place.
- `within_size`: also pages first touched by write(2) or fallocate, wherever the file's size
  covers the whole 2 MiB (`allow_within_size`). The DRAM tier needs it: a POSIX store is
  written into its object's memfd by the writer's kernel (passthrough), where no mapping can
  ask, into a file that must stay as long as what was written (its size is the object's).
  It is system-wide, the one policy the kernel has for memfds.
The daemons switch the policy as root, log it, and never lower it; `deny` or no such file:
4 KiB pages, as before.

Standard library only: bluecached.shm, which hostd.zerocopy's clients import, uses it.
"""

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
from pathlib import Path

log = logging.getLogger("bluecache.huge_pages")

SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
HONOURS_ADVICE = {"always", "within_size", "advise", "force"}
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)   # Linux 5.14, Python 3.12

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def shmem_policy(path: Path = SHMEM_ENABLED) -> str | None:
    """The policy in force (the bracketed word), or None where the kernel has none."""
    try:
        words = path.read_text().split()
    except OSError:
        return None
    chosen = [w[1:-1] for w in words if w.startswith("[") and w.endswith("]")]
    return chosen[0] if chosen else None


def allow_advised(path: Path = SHMEM_ENABLED) -> bool:
    """Whether a shared mapping that asks for 2 MiB pages gets them (hostd's staging),
    switching the policy from `never` to `advise` where needed."""
    policy = shmem_policy(path)
    if policy in HONOURS_ADVICE:
        return True
    if policy == "never":
        try:
            path.write_text("advise\n")
        except OSError as e:
            log.info("staging stays on 4 KiB pages: cannot set %s to advise (%s)", path,
                     e.strerror)
            return False
        log.info("%s: never -> advise, for hostd's staging region (mount.huge_pages; only "
                 "mappings that ask get 2 MiB pages)", path)
        return True
    log.info("staging stays on 4 KiB pages: the kernel's shmem huge page policy is %s",
             policy or "absent")
    return False


COVERS_WRITES = {"always", "within_size", "force"}


def allow_within_size(path: Path = SHMEM_ENABLED) -> bool:
    """Whether memfds get 2 MiB pages wherever their size covers them, however the pages
    are first touched: by a mapping, fallocate, or write(2) (the DRAM tier's objects that a
    writer's kernel writes by passthrough). `never` and `advise` become `within_size`.
    System-wide: every memfd and SysV segment of 2 MiB or more then gets them
    (docs/operations.md)."""
    policy = shmem_policy(path)
    if policy in COVERS_WRITES:
        return True
    if policy in ("never", "advise"):
        try:
            path.write_text("within_size\n")
        except OSError as e:
            log.info("the DRAM tier stays on 4 KiB pages: cannot set %s to within_size (%s)",
                     path, e.strerror)
            return False
        log.info("%s: %s -> within_size, for the DRAM tier's objects (tiers.dram.huge_pages: "
                 "memfds get 2 MiB pages where their size covers them; mappings that ask still "
                 "get them)", path, policy)
        return True
    log.info("the DRAM tier stays on 4 KiB pages: the kernel's shmem huge page policy is %s",
             policy or "absent")
    return False


def populate_huge(mapping: mmap.mmap) -> None:
    """Asks for 2 MiB pages for a shared mapping and allocates every page of it now.
    Blocking for as long as the kernel zeroes the memory (a worker thread's job where an
    event loop waits): ctypes lets go of the GIL for the call, mmap.madvise does not."""
    mapping.madvise(mmap.MADV_HUGEPAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    if _libc.madvise(ctypes.c_void_p(address), len(mapping), MADV_POPULATE_WRITE) == 0:
        return
    error = ctypes.get_errno()
    if error != errno.EINVAL:   # EINVAL: a kernel before 5.14; touching does the same
        raise OSError(error, f"madvise(MADV_POPULATE_WRITE): {os.strerror(error)}")
    for offset in range(0, len(mapping), mmap.PAGESIZE):
        mapping[offset] = mapping[offset]
