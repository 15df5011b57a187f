"""cffi builder of bluecached.dma._doca_api: the DOCA binding in API mode.

Compiled against NVIDIA's headers, so the compiler checks every declaration and enum value of
bluecached/dma/doca_binding.py against the installed SDK and passes `union doca_data` by value
as the C ABI says. setup.py builds it only where `pkg-config --exists doca-dma` (the DPU, with
the DOCA SDK; docs/hardware.md); elsewhere the binding uses ABI mode.

DOCA_API_HEADERS=simulator compiles the same declarations against the DOCA API simulator's
header instead (tests/unit/test_doca_api_mode.py does this to exercise API mode here).
"""

import importlib.util
import os
import shlex
import subprocess

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "_bluecache_doca_binding", os.path.join(HERE, "..", "bluecached", "dma", "doca_binding.py"))
_binding = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_binding)   # by path: a build environment has no trio to import

SDK_HEADERS = ["doca_types.h", "doca_error.h", "doca_version.h", "doca_dev.h", "doca_mmap.h",
               "doca_buf.h", "doca_buf_inventory.h", "doca_pe.h", "doca_ctx.h", "doca_dma.h"]


def sdk_available() -> bool:
    try:
        return subprocess.run(["pkg-config", "--exists", "doca-dma", "doca-common"],
                              check=False).returncode == 0
    except OSError:
        return False


def _pkg_config(*args: str) -> list[str]:
    out = subprocess.run(["pkg-config", *args, "doca-dma", "doca-common"], capture_output=True,
                         text=True, check=True).stdout
    return shlex.split(out)


def make_ffi(headers: str = "sdk", extra_link_args=()) -> FFI:
    ffi = FFI()
    ffi.cdef(_binding.cdef(api_mode=True))
    if headers == "simulator":
        source = '#include "doca_sim.h"\n'
        kwargs = {"include_dirs": [os.path.join(HERE, "doca_sim")],
                  "extra_link_args": list(extra_link_args)}
    else:
        source = "".join(f"#include <{h}>\n" for h in SDK_HEADERS)
        kwargs = {"define_macros": [("DOCA_ALLOW_EXPERIMENTAL_API", None)],
                  "extra_compile_args": _pkg_config("--cflags"),
                  "extra_link_args": _pkg_config("--libs")}
    ffi.set_source("bluecached.dma._doca_api", source, **kwargs)
    return ffi


# setup.py lists this builder only where the SDK is installed; importing it elsewhere (the
# tests) must not need one.
_headers = os.environ.get("DOCA_API_HEADERS", "sdk")
ffi = make_ffi(_headers) if _headers == "simulator" or sdk_available() else None

if __name__ == "__main__":
    ffi.compile(verbose=True)
