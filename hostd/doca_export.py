"""Host side of the DOCA engine: memory exported to the DPU with doca_mmap_export_pci.

hostd exports its staging slots once per process and, on the ioctl path, each client buffer
for the duration of one transfer. The descriptor (with the host address and length) goes to
bluecached only over the control channel — the local socket (0600, root) in embedded mode or
tcp+CURVE to the DPU — since whoever holds it can DMA into that memory.

Client memory:
- host memory (a memfd): mapped here, exported with doca_mmap_set_memrange;
- GPU memory as a dma-buf fd (cuMemGetHandleForAddressRange): doca_mmap_set_dmabuf_memrange
  (unproven on hardware: docs/hardware.md).
- GPU memory as a CUDA IPC handle: opened by hostd, exported as a dma-buf, else by its device
  address with doca_mmap_set_memrange (nvidia-peermem); see hostd/ioctl.py. Where neither
  works the caller gets EOPNOTSUPP and falls back to a host bounce buffer (cudaMemcpy into a
  SharedBuffer, then the same ioctl).
"""

import ctypes
import errno
import fcntl
import logging
import mmap
from dataclasses import dataclass

log = logging.getLogger("hostd.doca")
WRITE_SEALS = fcntl.F_SEAL_WRITE | 0x0010   # F_SEAL_FUTURE_WRITE (Linux 5.1; not in fcntl)
DMABUF_IOVA = 1 << 44   # page-aligned, and far from any host address (see export_dmabuf)


class ExportError(OSError):
    pass


class DocaSetupError(Exception):
    """hostd cannot do its part of the doca engine: a configuration problem, not a retry."""


@dataclass
class Export:
    mmap: object            # the doca_mmap
    descriptor: bytes
    address: int            # host address the DPU names buffers by
    length: int


class HostExporter:
    def __init__(self, library: str, pci_address: str):
        from bluecached.dma import doca_binding  # here: only a doca deployment needs cffi
        self.binding = doca_binding
        try:
            self.doca = doca_binding.load(library)
            self.pci_address = pci_address
            self.dev = doca_binding.open_device(self.doca, pci_address)
        except doca_binding.DocaError as e:
            raise ExportError(errno.EIO, str(e)) from None
        log.info("DOCA host exports through %s: %s", pci_address, self.doca.description)

    def export(self, address: int, length: int, writable: bool) -> Export:
        """Host memory [address, address + length): the DPU may read it, and write it if
        `writable` (a LOAD lands in it; a STORE only reads it)."""
        return self._export(lambda lib, m: lib.doca_mmap_set_memrange(
            m, self.doca.ffi.cast("void *", address), length), address, length, writable,
            "doca_mmap_set_memrange")

    def export_dmabuf(self, fd: int, offset: int, length: int, writable: bool) -> Export:
        """A dma-buf (GPU memory). hostd does not know the buffer's device address, so the
        export is addressed by an I/O virtual address of our choosing: DMABUF_IOVA + offset
        (DOCA passes it to the NIC as the registration's iova; not yet verified on hardware)."""
        iova = DMABUF_IOVA + offset
        return self._export(lambda lib, m: lib.doca_mmap_set_dmabuf_memrange(
            m, fd, self.doca.ffi.cast("void *", iova), offset, length), iova, length,
            writable, "doca_mmap_set_dmabuf_memrange")

    def _export(self, set_range, address: int, length: int, writable: bool,
                what: str) -> Export:
        doca, lib, ffi = self.doca, self.doca.lib, self.doca.ffi
        out = ffi.new("struct doca_mmap **")
        doca.check(lib.doca_mmap_create(out), "doca_mmap_create")
        m = out[0]
        try:
            doca.check(lib.doca_mmap_add_dev(m, self.dev), "doca_mmap_add_dev")
            access = (lib.DOCA_ACCESS_FLAG_PCI_READ_WRITE if writable
                      else lib.DOCA_ACCESS_FLAG_PCI_READ_ONLY)
            doca.check(lib.doca_mmap_set_permissions(
                m, access | lib.DOCA_ACCESS_FLAG_LOCAL_READ_WRITE), "doca_mmap_set_permissions")
            doca.check(set_range(lib, m), what)
            doca.check(lib.doca_mmap_start(m), "doca_mmap_start")
            desc, size = ffi.new("const void **"), ffi.new("size_t *")
            doca.check(lib.doca_mmap_export_pci(m, self.dev, desc, size), "doca_mmap_export_pci")
            descriptor = bytes(ffi.buffer(desc[0], size[0]))
        except self.binding.DocaError as e:
            lib.doca_mmap_destroy(m)
            err = errno.EOPNOTSUPP if e.name == "DOCA_ERROR_NOT_SUPPORTED" else errno.EIO
            raise ExportError(err, str(e)) from None
        return Export(m, descriptor, address, length)

    def unexport(self, export: Export) -> None:
        """After bluecached released the region: the DPU can no longer reach the memory."""
        err = self.doca.lib.doca_mmap_destroy(export.mmap)
        if err:
            log.warning("%s", self.doca.error(err, "doca_mmap_destroy"))

    def close(self) -> None:
        self.doca.lib.doca_dev_close(self.dev)


class MappedFd:
    """A client's memfd mapped into hostd so that its pages have a host address to export.
    hostd never reads or writes through the mapping."""

    def __init__(self, fd: int, length: int):
        try:
            # A memfd sealed against writing cannot be mapped shared and writable; a private
            # mapping has the same pages (the seal keeps them unchanged), which is all the
            # source of a STORE needs. Such memory is never the target of a LOAD.
            sealed = bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & WRITE_SEALS)
            self.writable = not sealed
            share = mmap.MAP_PRIVATE if sealed else mmap.MAP_SHARED
            self.map = mmap.mmap(fd, length, share, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise ExportError(errno.EOPNOTSUPP, f"cannot map the client's memory: {e}") from None
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    def close(self) -> None:
        self.map.close()
