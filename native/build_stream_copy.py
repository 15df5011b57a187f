"""cffi builder of bluecached.dma._stream_copy: the loopback engine's copy into the store with
streaming stores (stream_copy.c says why). Built by `pip install` (setup.py's cffi_modules);
it needs only a C compiler."""

import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))

ffi = FFI()
ffi.cdef("void bc_stream_copy(void *dst, const void *src, size_t n);")
ffi.set_source(
    "bluecached.dma._stream_copy",
    "void bc_stream_copy(void *dst, const void *src, size_t n);\n",
    sources=[os.path.relpath(os.path.join(HERE, "stream_copy.c"))],
    extra_compile_args=["-O2", "-Wall", "-Wextra"],
)

if __name__ == "__main__":
    ffi.compile(verbose=True)
