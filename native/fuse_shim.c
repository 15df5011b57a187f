/*
 * bluecache's shim between pyfuse3 and libfuse: the ioctl handler pyfuse3 lacks, and writes
 * received straight into hostd's staging slots.
 *
 * pyfuse3 calls libfuse's fuse_session_new@FUSE_3.0, fuse_session_receive_buf@FUSE_3.0 and
 * fuse_session_process_buf@FUSE_3.0. This library, loaded RTLD_GLOBAL before pyfuse3, defines
 * those symbols (same names and versions, see fuse_shim.map) and calls the real ones.
 *
 * ioctl: fuse_session_new copies pyfuse3's table of low-level operations, sets .ioctl and
 * hands each request to Python (bc_ioctl_to_python, a cffi "extern Python" function), which
 * answers it later with fuse_reply_ioctl/fuse_reply_err.
 *
 * Writes in place: pyfuse3 reads every request into a buffer of its own and copies a write's
 * payload into a new bytes object, which hostd then copies into a staging slot. Once hostd
 * has called bc_receive_into(), each request is read from /dev/fuse into the receive slot
 * instead, placed so that a write's payload starts exactly at the slot's payload offset (the
 * FUSE_WRITE header, fuse_in_header + fuse_write_in, lies just before it). If the request is
 * a write, the slot now holds its bytes: bc_write_buf hands the slot to Python
 * (bc_write_to_python) and the next request is read into a fresh one. Any other request
 * leaves the slot for the next. The copy the kernel makes in read(2) is then the only one on
 * hostd's side. Whenever that cannot work (no free slot, a payload elsewhere than expected)
 * the request takes pyfuse3's own path: slower, never wrong. Counters of both ways are kept
 * for hostd's stats and the tests.
 *
 * Between pyfuse3's receive and process calls there is no await (pyfuse3's _session_loop),
 * so one receive slot serves all of pyfuse3's worker tasks. Every pyfuse3 handler converts its
 * arguments to Python objects before returning, so the slot may be read into again as soon as
 * fuse_session_process_buf returns.
 *
 * libfuse 3.17 and newer reach these through differently versioned entry points: then this
 * shim is never called, bc_shim_state() stays 0 and hostd says so.
 */

/* Fixed by the FUSE protocol since 7.9: 40-byte fuse_in_header + 40-byte fuse_write_in. */
#define BC_WRITE_HEADER 80

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
typedef int (*bc_receive_fn)(struct fuse_session *, struct fuse_buf *);
typedef void (*bc_process_fn)(struct fuse_session *, const struct fuse_buf *);
typedef void (*bc_write_buf_fn)(fuse_req_t, fuse_ino_t, struct fuse_bufvec *, off_t,
                                struct fuse_file_info *);
typedef void (*bc_init_fn)(void *, struct fuse_conn_info *);

static struct fuse_lowlevel_ops bc_patched_ops;
static int bc_state; /* 0: not called, 1: ops patched, -1: table too new to patch */
static bc_write_buf_fn bc_pyfuse3_write_buf;
static bc_init_fn bc_pyfuse3_init;

/* The staging map, as hostd laid it out; base NULL until bc_receive_into(). */
static char *bc_base;
static size_t bc_stride, bc_payload, bc_slots;

static long bc_recv_slot = -1;              /* the slot requests are read into */
static struct fuse_buf bc_recv_buf;         /* what the last read produced ... */
static const struct fuse_buf *bc_recv_for;  /* ... and pyfuse3's buffer that stands for it */
static int bc_processing;                   /* inside fuse_session_process_buf on it */
static unsigned long long bc_in_place, bc_copied; /* writes served each way */

static char *bc_slot_payload(long slot)
{
    return bc_base + (size_t)slot * bc_stride + bc_payload;
}

static void bc_init(void *userdata, struct fuse_conn_info *conn)
{
    if (bc_pyfuse3_init)
        bc_pyfuse3_init(userdata, conn);
    /* libfuse turns splice on for any write_buf handler; a request must be read(2) into the
     * slot instead (a splice would leave the payload in a pipe). */
    conn->want &= ~FUSE_CAP_SPLICE_READ;
}

static void bc_write_buf(fuse_req_t req, fuse_ino_t ino, struct fuse_bufvec *bufv, off_t off,
                         struct fuse_file_info *fi)
{
    const struct fuse_buf *b = &bufv->buf[0];
    if (bc_processing && bc_recv_slot >= 0 && bufv->count == 1 && bufv->idx == 0 &&
        !(b->flags & FUSE_BUF_IS_FD) &&
        (char *)b->mem + bufv->off == bc_slot_payload(bc_recv_slot)) {
        long slot = bc_recv_slot;
        bc_recv_slot = -1; /* Python owns it now */
        bc_in_place++;
        bc_write_to_python(req, ino, fi->fh, off, slot, b->size - bufv->off);
        return;
    }
    bc_copied++;
    bc_pyfuse3_write_buf(req, ino, bufv, off, fi);
}

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
    if (bc_patched_ops.write_buf) {
        bc_pyfuse3_write_buf = bc_patched_ops.write_buf;
        bc_patched_ops.write_buf = bc_write_buf;
        bc_pyfuse3_init = bc_patched_ops.init;
        bc_patched_ops.init = bc_init;
    }
    bc_state = 1;
    return real(args, &bc_patched_ops, sizeof(bc_patched_ops), userdata);
}

__attribute__((visibility("default")))
int fuse_session_receive_buf(struct fuse_session *se, struct fuse_buf *buf)
{
    static bc_receive_fn real;
    if (real == NULL)
        real = (bc_receive_fn)dlvsym(RTLD_NEXT, "fuse_session_receive_buf", "FUSE_3.0");
    if (real == NULL)
        return -ENOSYS;
    if (bc_base == NULL || bc_pyfuse3_write_buf == NULL)
        return real(se, buf);
    if (bc_recv_slot < 0) {
        long slot = bc_take_slot();
        bc_recv_slot = slot >= 0 && (size_t)slot < bc_slots ? slot : -1;
    }
    if (bc_recv_slot < 0) /* every slot is in flight: pyfuse3's buffer, and its copy */
        return real(se, buf);
    struct fuse_buf into = {.mem = bc_slot_payload(bc_recv_slot) - BC_WRITE_HEADER};
    int res = real(se, &into);
    if (res > 0) {
        bc_recv_buf = into;
        bc_recv_for = buf;
        /* pyfuse3 looks at nothing but the result; its own buffer stays as it was (it frees
         * it when the worker ends). */
    }
    return res;
}

__attribute__((visibility("default")))
void fuse_session_process_buf(struct fuse_session *se, const struct fuse_buf *buf)
{
    static bc_process_fn real;
    if (real == NULL)
        real = (bc_process_fn)dlvsym(RTLD_NEXT, "fuse_session_process_buf", "FUSE_3.0");
    if (real == NULL)
        return;
    if (bc_recv_for == NULL || buf != bc_recv_for) {
        real(se, buf);
        return;
    }
    struct fuse_buf received = bc_recv_buf;
    bc_recv_for = NULL;
    bc_processing = 1;
    real(se, &received);
    bc_processing = 0;
}

int bc_shim_state(void)
{
    return bc_state;
}

/* Reads requests into hostd's staging from now on (see the top of this file). The map is
 * `slots` strides of `stride` bytes; a slot's payload starts `payload` bytes into its stride.
 * Returns 0, or -1 if the shim cannot do it (libfuse did not call it, or a read could run
 * past the slot's stride). */
int bc_receive_into(char *base, size_t slots, size_t stride, size_t payload)
{
    /* libfuse < 3.17 reads up to FUSE_MAX_MAX_PAGES (256) pages + FUSE_BUFFER_HEADER_SIZE
     * (4 KiB) per request: all of that must fit from the header on. */
    size_t libfuse_bufsize = 256 * (size_t)getpagesize() + 0x1000;
    if (bc_state != 1 || bc_pyfuse3_write_buf == NULL || payload < BC_WRITE_HEADER ||
        stride < payload || stride - payload + BC_WRITE_HEADER < libfuse_bufsize)
        return -1;
    bc_stride = stride;
    bc_payload = payload;
    bc_slots = slots;
    bc_base = base;
    return 0;
}

/* Back to pyfuse3's buffers; returns the receive slot the shim held (or -1) for hostd to
 * reuse. Called between requests, never inside one. */
long bc_receive_stop(void)
{
    long slot = bc_recv_slot;
    bc_base = NULL;
    bc_recv_slot = -1;
    bc_recv_for = NULL;
    return slot;
}

unsigned long long bc_writes_in_place(void)
{
    return bc_in_place;
}

unsigned long long bc_writes_copied(void)
{
    return bc_copied;
}
