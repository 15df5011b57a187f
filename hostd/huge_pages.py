"""2 MiB pages for hostd's staging region (mount.huge_pages).

An NVMe hit is read by bluecached with O_DIRECT straight into a staging slot. How fast such a
read runs depends on how the destination memory lies, not only on the disk: on the 2-core
Firecracker VM the benchmarks run on, 32 MiB read as 8 x 4 MiB into a memfd of 4 KiB pages took
13.1 ms, into the same memfd on 2 MiB pages 9.1 ms, a plain file read whole into a process's
buffer 12.9 ms (bench/staging_pages.py, 3 runs, docs/benchmarks/staging-pages.md; ad hoc
probes saw 4 KiB pages as slow as 17.3 ms). Why the disk cares was not measured (the likely
reason: fewer, larger memory segments per request); on a host without a hypervisor it may
matter less, and a 2 MiB page costs nothing more here.

A memfd gets 2 MiB pages only where the kernel's shmem policy allows them:
/sys/kernel/mm/transparent_hugepage/shmem_enabled. `advise` (huge pages for mappings that ask
with madvise(MADV_HUGEPAGE), nothing else changes) is what hostd needs; Debian and many
distributions boot with `never`, which hostd then switches to `advise` (as root; it changes
nothing for a process that does not ask). `deny` or no such file: 4 KiB pages, as before.
"""

import logging
from pathlib import Path

log = logging.getLogger("hostd")

SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
HONOURS_ADVICE = {"always", "within_size", "advise", "force"}


def shmem_policy(path: Path = SHMEM_ENABLED) -> str | None:
    """The policy in force (the bracketed word), or None where the kernel has none."""
    try:
        words = path.read_text().split()
    except OSError:
        return None
    chosen = [w[1:-1] for w in words if w.startswith("[") and w.endswith("]")]
    return chosen[0] if chosen else None


def allow_advised(path: Path = SHMEM_ENABLED) -> bool:
    """Whether a shared mapping that asks for 2 MiB pages gets them, switching the policy
    from `never` to `advise` where needed."""
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
