"""A real FUSE mount of fusefs.Operations over the in-memory cache (tests/fs/memory_cache.py),
through the fuse shim as hostd loads it: the kernel's side of passthrough without bluecached.

    python tests/mount/memory_mount.py MOUNTPOINT STATS_JSON [--no-passthrough] [--max-pages N]

Writes STATS_JSON once mounted and again on SIGUSR1 (what the cache was asked, what the shim
negotiated and counted); SIGTERM unmounts and exits.
"""

import argparse
import json
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "fs")]

from hostd.shim import load_shim  # noqa: E402  (before pyfuse3)

SHIM, PROBLEM = load_shim()

import pyfuse3  # noqa: E402
import trio  # noqa: E402
from memory_cache import MemoryCache  # noqa: E402

from fusefs import Operations  # noqa: E402
from fusefs.ioctl import IoctlDispatch  # noqa: E402
from fusefs.passthrough import Passthrough  # noqa: E402


class NoTransfers:
    """No zero-copy ioctl here: every ioctl (e.g. open()'s TCGETS) gets ENOTTY."""
    commands = frozenset()
    changing = frozenset()


def stats(cache: MemoryCache, passthrough: Passthrough | None) -> dict:
    lib = SHIM.lib
    return {"reads": cache.calls.count("read"), "backing_calls": cache.calls.count("backing"),
            "releases": cache.calls.count("release"), "flushes": cache.calls.count("flush"),
            "passthrough": lib.bc_passthrough_state(), "max_pages": lib.bc_max_pages(),
            "kernel_minor": lib.bc_kernel_minor(), "replies": lib.bc_passthrough_opens(),
            "backings_opened": lib.bc_backings_opened_count(),
            "backings_closed": lib.bc_backings_closed_count(),
            "inodes_backed": len(passthrough.inodes) if passthrough else 0,
            "served": passthrough.served if passthrough else 0}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mountpoint")
    parser.add_argument("stats")
    parser.add_argument("--no-passthrough", action="store_true")
    parser.add_argument("--max-pages", type=int, default=0)
    args = parser.parse_args()
    if SHIM is None:
        print(PROBLEM, file=sys.stderr)
        return 2
    use = not args.no_passthrough
    if SHIM.lib.bc_negotiate(int(use), args.max_pages) != 0:
        print("the shim does not serve pyfuse3", file=sys.stderr)
        return 2
    cache = MemoryCache()
    # grace 0: the tests here count backing ids closed at each release
    passthrough = Passthrough(SHIM, grace=0) if use else None
    ops = Operations(cache, passthrough=passthrough)
    pyfuse3.init(ops, args.mountpoint, set(pyfuse3.default_options) | {"fsname=memtest"})

    def dump():
        tmp = args.stats + ".tmp"
        with open(tmp, "w") as f:
            json.dump(stats(cache, passthrough), f)
        os.replace(tmp, args.stats)

    async def run():
        with trio.open_signal_receiver(signal.SIGUSR1, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(IoctlDispatch(SHIM, NoTransfers()).run)
                nursery.start_soon(pyfuse3.main)
                await trio.sleep(0.2)   # INIT answered (the kernel sends it at mount)
                dump()
                async for signum in signals:
                    if signum == signal.SIGUSR1:
                        dump()
                        continue
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(run)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
