#!/usr/bin/env python3
"""Supplying a fresh memfd's pages, as a promotion from NVMe needs them: faulted in one by one
by the kernel (MADV_POPULATE_WRITE, what an O_DIRECT read into the mapping pays) vs fallocate
(what Tiers.promote does first, bluecached/tiers/placement.py). 256 MiB, 5 of each per run, 3 runs,
both in the same run; prints GiB/s medians with their range. `python3 bench/memfd_supply.py`"""
import mmap
import os
import time

N = 256 << 20
POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)   # Linux 5.14; Python 3.11 lacks the name


def faulted() -> float:
    fd = os.memfd_create("faulted")
    os.ftruncate(fd, N)
    m = mmap.mmap(fd, N)
    t = time.perf_counter()
    m.madvise(POPULATE_WRITE)
    t = time.perf_counter() - t
    m.close()
    os.close(fd)
    return N / t / 2**30


def fallocated() -> float:
    fd = os.memfd_create("fallocated")
    os.ftruncate(fd, N)
    t = time.perf_counter()
    os.posix_fallocate(fd, 0, N)
    t = time.perf_counter() - t
    os.close(fd)
    return N / t / 2**30


def main() -> None:
    for run in range(3):
        a = sorted(faulted() for _ in range(5))
        b = sorted(fallocated() for _ in range(5))
        print(f"run {run + 1}: faulted median {a[2]:.2f} [{a[0]:.2f}-{a[4]:.2f}] GiB/s, "
              f"fallocated median {b[2]:.2f} [{b[0]:.2f}-{b[4]:.2f}] GiB/s, "
              f"ratio {b[2] / a[2]:.2f}x")


if __name__ == "__main__":
    main()
