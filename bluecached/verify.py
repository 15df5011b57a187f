"""`bluecachectl verify`: re-reads every object on NVMe and checks its CRC32C.

Reads into private buffers (not the DRAM tier) so verifying does not evict anything. An object
that fails is removed like any checksum failure: it must never be served.
"""

import logging
import mmap
import time

import trio

from .tiers.dram import CHUNK_SIZE
from .tiers.objects import chunk_count
from .tiers.promotion import read_and_verify

log = logging.getLogger("bluecached.verify")


class Verifier:
    def __init__(self, store):
        self.store = store
        self.state = {"running": False, "done": 0, "total": 0, "bytes": 0, "failed": 0,
                      "started": None, "finished": None}

    def progress(self) -> dict:
        return dict(self.state)

    def start(self, nursery: trio.Nursery) -> None:
        if not self.state["running"]:
            self.state.update(running=True, done=0, bytes=0, failed=0,
                              started=time.time(), finished=None)
            nursery.start_soon(self.run)

    async def run(self) -> None:
        store = self.store
        tiers = store.tiers
        nodes = [n for n in tiers.lru_nvme.values() if n.obj.persisted]
        self.state["total"] = len(nodes)
        buffers: list[mmap.mmap] = []
        try:
            for node in nodes:
                obj = node.obj
                async with obj.content_lock():  # the extent cannot be freed under us
                    if obj.persisted and obj.extent is not None:
                        n = chunk_count(node.size)
                        while len(buffers) < n:
                            buffers.append(mmap.mmap(-1, CHUNK_SIZE))
                        try:
                            bad = await trio.to_thread.run_sync(
                                read_and_verify, tiers.nvme, obj.extent, buffers[:n],
                                node.size, obj.crcs)
                        except OSError as e:
                            log.error("verify: reading inode %d failed: %s", node.ino, e)
                            bad = 0
                        if bad >= 0:
                            self.state["failed"] += 1
                            tiers.stats.checksum_failures += 1
                            log.error("verify: checksum mismatch in inode %d (%s): removed",
                                      node.ino, store.ns.path_of(node).decode(errors="replace"))
                            tiers.drop_dram(node)
                            store.remove_object(node, "checksum mismatch")
                        self.state["bytes"] += node.size
                self.state["done"] += 1
        finally:
            for b in buffers:
                b.close()
            self.state.update(running=False, finished=time.time())
