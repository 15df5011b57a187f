"""cffi builder of bluecached.dma._doca_sim: the DOCA API simulator (doca_sim/doca_sim.c).

The simulator is built as a cffi extension only so that `pip install` and the Debian build
(setup.py's cffi_modules) compile it with no extra step; nothing imports it as a module. The
DOCA engine dlopens the resulting shared object by path and finds the DOCA symbols in it
(doca_mmap_create, doca_dma_task_memcpy_alloc_init, ...) under their real names.
"""

import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
SIM = os.path.join(HERE, "doca_sim")

ffi = FFI()
ffi.cdef("const char *doca_error_get_name(int error);")
ffi.set_source(
    "bluecached.dma._doca_sim",
    '#include "doca_sim.h"\n',
    sources=[os.path.relpath(os.path.join(SIM, "doca_sim.c"))],
    include_dirs=[SIM],
    depends=[os.path.join(SIM, "doca_sim.h")],
    extra_compile_args=["-Wall", "-Wextra", "-Wno-unused-parameter", "-pthread"],
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    ffi.compile(verbose=True)
