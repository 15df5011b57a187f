# Only for what pyproject.toml cannot say: the cffi-built native parts (native/): the ioctl
# shim and the DOCA API simulator.
from setuptools import setup

setup(cffi_modules=["native/build_fuse_shim.py:ffi", "native/build_doca_sim.py:ffi"])
