"""Windows the DRAM pool maps ahead may be page-locked by the engine (CUDA, after_map); each
must be handed to before_unmap before it is unmapped. A registration left on an unmapped
range makes the next mapping at that address unregistrable (CUDA:
HOST_MEMORY_ALREADY_REGISTERED), which the CUDA tests once hit after spares were trimmed."""

import ctypes

from bluecached.tiers.dram import CHUNK_SIZE, DramPool, populated_memfd, zero_windows


class Registrations:
    """The engine's side: which mapped windows are page-locked."""

    def __init__(self):
        self.pinned: dict[int, object] = {}

    def pin(self, chunk) -> None:
        self.pinned[ctypes.addressof(ctypes.c_char.from_buffer(chunk))] = chunk

    def unpin(self, chunk) -> None:
        if not chunk.closed:
            self.pinned.pop(ctypes.addressof(ctypes.c_char.from_buffer(chunk)), None)

    def left_on_unmapped(self) -> list[int]:
        return [address for address, chunk in self.pinned.items() if chunk.closed]


def test_every_window_mapped_ahead_is_unpinned_before_it_is_unmapped():
    regs = Registrations()
    pool = DramPool(64 * CHUNK_SIZE, before_unmap=regs.unpin, after_map=regs.pin)
    try:
        pool.add_spare(populated_memfd(8, pool.after_map))
        pool.add_spare(populated_memfd(8, pool.after_map))
        assert len(regs.pinned) == 16
        trimmed = pool.new_memfd(3 * CHUNK_SIZE)    # a spare cut to a smaller object
        assert len(trimmed.ahead) == 3 and not regs.left_on_unmapped()
        trimmed.drop_ahead()                        # complete without taking them
        assert not regs.left_on_unmapped()
        trimmed.close()
        reused = pool.new_memfd(None)               # a spare taken whole, then freed
        chunks = [pool.take(reused, i) for i in range(2)]
        pool.give_content(reused, chunks)
        zero_windows(reused, pool.after_map)        # map_ahead's part
        pool.add_spare(reused)
        assert not regs.left_on_unmapped()
    finally:
        pool.close()
    assert not regs.left_on_unmapped()
    assert not regs.pinned, "page-locks left after the pool closed"
