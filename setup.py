# Only for what pyproject.toml cannot say: the cffi-built native parts (native/): the fuse
# shim (ioctl, writes received in place, its reader thread), the DOCA API simulator, the
# loopback engine's streaming copy, and the DOCA binding in API mode where the DOCA SDK is
# installed.
import subprocess

from setuptools import setup


def _doca_sdk() -> bool:
    try:
        return subprocess.run(["pkg-config", "--exists", "doca-dma", "doca-common"],
                              check=False).returncode == 0
    except OSError:
        return False


modules = ["native/build_fuse_shim.py:ffi", "native/build_doca_sim.py:ffi",
           "native/build_stream_copy.py:ffi"]
if _doca_sdk():
    modules.append("native/build_doca_api.py:ffi")
setup(cffi_modules=modules)
