/*
 * bluecache's ioctl shim for pyfuse3.
 *
 * pyfuse3 has no ioctl handler. It calls libfuse's fuse_session_new@FUSE_3.0 with its table of
 * low-level operations; this library, loaded RTLD_GLOBAL before pyfuse3, defines that symbol
 * (same name and version, see fuse_ioctl_shim.map), copies the table, sets .ioctl and calls the
 * real function. The ioctl callback hands each request to Python (bc_ioctl_to_python, a cffi
 * "extern Python" function) which answers it later with fuse_reply_ioctl/fuse_reply_err.
 *
 * libfuse 3.17 and newer reach fuse_session_new through a differently versioned entry point:
 * then this function is never called, bc_shim_state() stays 0 and hostd says so.
 */

static void bc_ioctl(fuse_req_t req, fuse_ino_t ino, unsigned int cmd, void *arg,
                     struct fuse_file_info *fi, unsigned flags, const void *in_buf,
                     size_t in_bufsz, size_t out_bufsz)
{
    (void)arg;
    bc_ioctl_to_python(req, ino, cmd, fi ? fi->fh : 0, flags, in_buf, in_bufsz, out_bufsz);
}

typedef struct fuse_session *(*bc_session_new_fn)(struct fuse_args *,
                                                 const struct fuse_lowlevel_ops *, size_t,
                                                 void *);

static struct fuse_lowlevel_ops bc_patched_ops;
static int bc_state; /* 0: not called, 1: ioctl installed, -1: table too new to patch */

__attribute__((visibility("default")))
struct fuse_session *fuse_session_new(struct fuse_args *args,
                                      const struct fuse_lowlevel_ops *op, size_t op_size,
                                      void *userdata)
{
    bc_session_new_fn real = (bc_session_new_fn)dlvsym(RTLD_NEXT, "fuse_session_new",
                                                        "FUSE_3.0");
    if (real == NULL)
        return NULL;
    if (op_size > sizeof(bc_patched_ops)) {
        /* A newer table than these headers know: patching it would cut it short. */
        bc_state = -1;
        return real(args, op, op_size, userdata);
    }
    memset(&bc_patched_ops, 0, sizeof(bc_patched_ops));
    memcpy(&bc_patched_ops, op, op_size);
    bc_patched_ops.ioctl = bc_ioctl;
    bc_state = 1;
    return real(args, &bc_patched_ops, sizeof(bc_patched_ops), userdata);
}

int bc_shim_state(void)
{
    return bc_state;
}
