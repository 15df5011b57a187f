"""The ioctl ABI of include/bluecache_ioctl.h, for Python: layouts, commands, packing.

The tests compile a C program against the header and check these against it.
"""

import struct
from dataclasses import dataclass

VERSION = 1
MAGIC = 0xBC

MEM_MEMFD = 1
MEM_DMABUF = 2
MEM_CUDA_IPC = 3
MEM_KINDS = {MEM_MEMFD: "memfd", MEM_DMABUF: "dmabuf", MEM_CUDA_IPC: "cuda_ipc"}

TIER_DRAM = 1
TIER_NVME = 2

# struct bluecache_ioc_xfer
XFER = struct.Struct("<IIIiQQQQ64sQQ128s")
# struct bluecache_ioc_query
QUERY = struct.Struct("<IIQIIQQ24s")

_IOC_WRITE, _IOC_READ = 1, 2


def _iowr(nr: int, size: int) -> int:
    return ((_IOC_READ | _IOC_WRITE) << 30) | (size << 16) | (MAGIC << 8) | nr


IOC_STORE = _iowr(1, XFER.size)
IOC_LOAD = _iowr(2, XFER.size)
IOC_QUERY = _iowr(3, QUERY.size)


@dataclass
class Xfer:
    version: int = VERSION
    struct_size: int = XFER.size
    mem_kind: int = MEM_MEMFD
    fd: int = -1
    mem_offset: int = 0
    length: int = 0
    file_offset: int = 0
    flags: int = 0
    cuda_ipc_handle: bytes = bytes(64)
    result_length: int = 0
    file_size: int = 0
    reserved: bytes = bytes(128)

    def pack(self) -> bytes:
        return XFER.pack(self.version, self.struct_size, self.mem_kind, self.fd,
                         self.mem_offset, self.length, self.file_offset, self.flags,
                         self.cuda_ipc_handle, self.result_length, self.file_size,
                         self.reserved)

    @classmethod
    def unpack(cls, data: bytes) -> "Xfer":
        return cls(*XFER.unpack(data))


@dataclass
class Query:
    version: int = VERSION
    struct_size: int = QUERY.size
    file_size: int = 0
    tiers: int = 0
    crc32c: int = 0
    hostd_bytes_copied: int = 0
    zero_copy_bytes: int = 0
    reserved: bytes = bytes(24)

    def pack(self) -> bytes:
        return QUERY.pack(self.version, self.struct_size, self.file_size, self.tiers,
                          self.crc32c, self.hostd_bytes_copied, self.zero_copy_bytes,
                          self.reserved)

    @classmethod
    def unpack(cls, data: bytes) -> "Query":
        return cls(*QUERY.unpack(data))
