"""cffi builder of hostd._fuse_shim (API mode: compiled against libfuse 3's headers).

Built by `pip install` (setup.py's cffi_modules) where libfuse3-dev and pkg-config are
installed. See fuse_shim.c for why it exists and what it does.
"""

import os
import shlex
import subprocess

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))


def _pkg_config(*args: str) -> list[str]:
    try:
        out = subprocess.run(["pkg-config", *args, "fuse3"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError("libfuse 3 development files not found (apt-get install "
                           "libfuse3-dev pkg-config)") from e
    return shlex.split(out)


ffi = FFI()
ffi.cdef("""
typedef uint64_t fuse_ino_t;
typedef struct fuse_req *fuse_req_t;
typedef int... uid_t;
typedef int... gid_t;
typedef int... pid_t;
struct fuse_ctx { uid_t uid; gid_t gid; pid_t pid; ...; };
const struct fuse_ctx *fuse_req_ctx(fuse_req_t req);
int fuse_reply_ioctl(fuse_req_t req, int result, const void *buf, size_t size);
int fuse_reply_err(fuse_req_t req, int err);
int fuse_version(void);
int bc_shim_state(void);
int bc_receive_into(char *base, size_t slots, size_t stride, size_t payload);
long bc_receive_stop(void);
int bc_use_reader_thread(void);
int bc_reader_state(void);
unsigned long long bc_writes_in_place(void);
unsigned long long bc_writes_copied(void);
int fuse_reply_write(fuse_req_t req, size_t count);
typedef long... off_t;
int bc_take_write_kill(uint64_t fh, off_t off);
int bc_negotiate(int passthrough, int max_pages);
int bc_passthrough_state(void);
int bc_max_pages(void);
int bc_kernel_minor(void);
int bc_negotiate_request_timeout(int seconds);
int bc_request_timeout_state(void);
int bc_shared_mmap_state(void);
int bc_backing_open(int fd);
int bc_backing_close(int backing_id);
#define BC_PT_KERNEL_READS 0
#define BC_PT_DAEMON_IO 1
#define BC_PT_KERNEL_WRITES 2
int bc_passthrough_set(uint64_t fh, int backing_id, int mode);
void bc_passthrough_clear(uint64_t fh);
unsigned long long bc_passthrough_opens(void);
unsigned long long bc_backings_opened_count(void);
unsigned long long bc_backings_closed_count(void);
extern "Python" void bc_ioctl_to_python(fuse_req_t req, fuse_ino_t ino, unsigned int cmd,
                                        uint64_t fh, unsigned flags, const void *in_buf,
                                        size_t in_bufsz, size_t out_bufsz);
extern "Python" long bc_take_slot(void);
extern "Python" void bc_give_slot(long slot);
extern "Python" void bc_write_to_python(fuse_req_t req, fuse_ino_t ino, uint64_t fh, off_t off,
                                        long slot, size_t size);
""")

with open(os.path.join(HERE, "fuse_shim.c")) as f:
    _shim = f.read()

ffi.set_source(
    "hostd._fuse_shim",
    "#define FUSE_USE_VERSION 35\n#define _GNU_SOURCE\n#include <dlfcn.h>\n#include <errno.h>\n"
    "#include <fcntl.h>\n#include <pthread.h>\n#include <signal.h>\n#include <stddef.h>\n"
    "#include <stdint.h>\n#include <stdlib.h>\n#include <string.h>\n#include <sys/eventfd.h>\n"
    "#include <sys/ioctl.h>\n"
    "#include <sys/uio.h>\n#include <unistd.h>\n"
    "#include <fuse_lowlevel.h>\n"
    "static void bc_ioctl_to_python(fuse_req_t, fuse_ino_t, unsigned int, uint64_t, unsigned,"
    " const void *, size_t, size_t);\n"
    "static long bc_take_slot(void);\n"
    "static void bc_give_slot(long);\n"
    "static void bc_write_to_python(fuse_req_t, fuse_ino_t, uint64_t, off_t, long, size_t);\n"
    + _shim,
    extra_compile_args=_pkg_config("--cflags"),
    extra_link_args=_pkg_config("--libs")
    + [f"-Wl,--version-script={os.path.join(HERE, 'fuse_shim.map')}", "-ldl", "-lpthread"],
)

if __name__ == "__main__":
    ffi.compile(verbose=True)
