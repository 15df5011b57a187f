# Only for what pyproject.toml cannot say: the cffi-built ioctl shim (native/).
from setuptools import setup

setup(cffi_modules=["native/build_fuse_shim.py:ffi"])
