/*
 * bluecache's shim between pyfuse3 and libfuse: the ioctl handler pyfuse3 lacks, writes
 * received straight into hostd's staging slots, and a thread of its own reading /dev/fuse.
 *
 * pyfuse3 calls libfuse's fuse_session_new, fuse_session_fd, fuse_session_receive_buf,
 * fuse_session_process_buf, fuse_session_unmount and fuse_session_destroy (all @FUSE_3.0). This library, loaded
 * RTLD_GLOBAL before pyfuse3, defines those symbols (same names and versions, see
 * fuse_shim.map) and calls the real ones.
 *
 * ioctl: fuse_session_new copies pyfuse3's table of low-level operations, sets .ioctl and
 * hands each request to Python (bc_ioctl_to_python, a cffi "extern Python" function), which
 * answers it later with fuse_reply_ioctl/fuse_reply_err.
 *
 * Writes in place: pyfuse3 reads every request into a buffer of its own and copies a write's
 * payload into a new bytes object, which hostd then copies into a staging slot. Once hostd
 * has called bc_receive_into(), requests are read from /dev/fuse into staging slots instead,
 * placed so that a write's payload starts exactly at the slot's payload offset (the
 * FUSE_WRITE header, fuse_in_header + fuse_write_in, lies just before it). If the request is
 * a write, the slot now holds its bytes: bc_write_buf hands the slot to Python
 * (bc_write_to_python). Any other request gives the slot back for the next read. The copy
 * the kernel makes in read(2) is then the only one on hostd's side. Whenever that cannot work
 * (no free slot, a payload elsewhere than expected) the request takes pyfuse3's own path:
 * slower, never wrong. Counters of both ways are kept for hostd's stats and the tests.
 *
 * The reader thread (bc_use_reader_thread(), before pyfuse3.init): that copy in read(2) is
 * most of what hostd's one event-loop thread does for a write (docs/benchmarks/mount.md). A
 * thread of this library then does all the reading, ahead of the event loop, into a short
 * queue; fuse_session_fd hands pyfuse3 an eventfd that is readable while the
 * queue holds one, and fuse_session_receive_buf takes the next from the queue. Processing
 * stays in pyfuse3's loop, in the order read. Without it, receive_buf reads inline as libfuse
 * would.
 *
 * Between pyfuse3's receive and process calls there is no await (pyfuse3's _session_loop), so
 * one "current request" serves all of pyfuse3's worker tasks. Every pyfuse3 handler converts
 * its arguments to Python objects before returning, so a request's buffer may be read into
 * again as soon as fuse_session_process_buf returns.
 *
 * Set-user-ID and set-group-ID bits: with direct_io the kernel clears nothing when a user
 * without CAP_FSETID writes; it sets FUSE_WRITE_KILL_SUIDGID in the write's write_flags and
 * leaves it to the file system. libfuse 3.14 hands pyfuse3 no write_flags, so bc_write_buf
 * reads them from the request (its fuse_write_in lies just before the payload) and Python
 * asks with bc_take_write_kill() while it takes that write (hostd/link.py).
 *
 * Passthrough (bc_negotiate(), before pyfuse3.init): libfuse 3.14 knows neither
 * FUSE_PASSTHROUGH nor a max_pages of its own choosing, but it has fuse_session_custom_io,
 * whose read and writev then carry every request and reply. fuse_session_mount installs
 * them on the /dev/fuse fd it opened; read notes which requests are INIT and OPEN, writev
 * rewrites their replies: INIT takes FUSE_PASSTHROUGH (+ max_stack_depth 1) and a larger
 * max_pages where the kernel offered them, and an OPEN reply for a handle hostd registered
 * (bc_passthrough_set) carries FOPEN_PASSTHROUGH and its backing id. The backing ids come from
 * the FUSE_DEV_IOC_BACKING_OPEN/CLOSE ioctls on that fd (bc_backing_open/close). The ABI is the
 * kernel's (protocol 7.41+; this machine's kernel speaks 7.45, Debian's headers 7.38), defined
 * below with its sizes asserted. Without bc_negotiate nothing of this is installed.
 *
 * libfuse 3.17 and newer reach these through differently versioned entry points: then this
 * shim is never called, bc_shim_state() stays 0 and hostd says so.
 */

/* Fixed by the FUSE protocol since 7.9: 40-byte fuse_in_header + 40-byte fuse_write_in. */
#define BC_WRITE_HEADER 80
/* Requests read ahead, each in a slot or a spare buffer; the reader waits while the queue is
 * full. 16 against 4 and 64 (ad hoc, 8 and 64 llm-d writers, 2-core Intel Xeon VM): 4 -> 16
 * stored 4% (8 writers) and 14% (64) more, with less CPU per GiB (the event loop finds
 * several writes at once, and they share one daemon message); 64 did no better than 16. A
 * short queue holds few slots, and few requests the kernel forgets when the connection ends
 * before they are answered. */
#define BC_QUEUE 16
/* The pool of staging slots kept free for reading into is topped up (by the event loop) to
 * bc_pool_target: with the reader thread, one per request that can be out of it between two
 * top-ups (a full queue, one being read, one being processed); without, one request is read
 * at a time. Slots coming back from requests out can lift the pool to BC_POOL_MAX; the event
 * loop hands any beyond the target back to hostd. */
#define BC_POOL_MAX (2 * (BC_QUEUE + 2))
#define BC_SPARES_MAX 16  /* libfuse-sized buffers kept for requests that get no slot */

/* The kernel's struct fuse_write_in (protocol 7.9+) and its write_flags bit that asks the file
 * system to clear S_ISUID/S_ISGID (FUSE_WRITE_KILL_SUIDGID; FUSE_WRITE_KILL_PRIV before 7.31). */
struct bc_write_in {
    uint64_t fh;
    uint64_t offset;
    uint32_t size;
    uint32_t write_flags;
    uint64_t lock_owner;
    uint32_t flags;
    uint32_t padding;
};
_Static_assert(sizeof(struct bc_write_in) == 40, "fuse_write_in is 40 bytes");
#define BC_WRITE_KILL_SUIDGID (1u << 2)

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
typedef int (*bc_fd_fn)(struct fuse_session *);
typedef void (*bc_session_fn)(struct fuse_session *);
typedef void (*bc_write_buf_fn)(fuse_req_t, fuse_ino_t, struct fuse_bufvec *, off_t,
                                struct fuse_file_info *);
typedef void (*bc_init_fn)(void *, struct fuse_conn_info *);

/* libfuse's own definition of one of the functions this library defines. */
static void *bc_libfuse(const char *name)
{
    return dlvsym(RTLD_NEXT, name, "FUSE_3.0");
}

static struct fuse_lowlevel_ops bc_patched_ops;
static int bc_state; /* 0: not called, 1: ops patched, -1: table too new to patch */
static bc_write_buf_fn bc_pyfuse3_write_buf;
static bc_init_fn bc_pyfuse3_init;
static bc_receive_fn bc_real_receive;

/* The staging map, as hostd laid it out; base NULL until bc_receive_into(). Event loop only. */
static char *bc_base;
static size_t bc_stride, bc_payload, bc_slots;

/* A request read from /dev/fuse: into a staging slot (slot >= 0), or into a spare buffer. */
struct bc_request {
    struct fuse_buf buf; /* as libfuse filled it */
    long slot;
    int res;             /* receive_buf's result */
};

/* Shared by the reader thread and the event loop, under bc_lock. */
static pthread_mutex_t bc_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t bc_room = PTHREAD_COND_INITIALIZER; /* the queue has room */
static long bc_pool[BC_POOL_MAX];
static int bc_pool_n, bc_pool_target;
static void *bc_spares[BC_SPARES_MAX];
static int bc_spares_n;
static struct bc_request bc_queue[BC_QUEUE];
static int bc_queue_head, bc_queue_n;
static int bc_stopping;

static int bc_want_reader;   /* bc_use_reader_thread() was called */
static int bc_event_fd = -1; /* readable while bc_queue_n > 0 */
static pthread_t bc_reader;
static int bc_reader_running, bc_reader_joinable;

/* The event loop's current request (between receive and the end of process). */
static struct bc_request bc_current;
static const struct fuse_buf *bc_current_for; /* pyfuse3's buffer that stands for it */
static long bc_current_slot = -1; /* its slot, while processed and still the shim's */
static unsigned long long bc_in_place, bc_copied; /* writes served each way */
/* The write being handed to Python and whether it asks to clear S_ISUID/S_ISGID. */
static uint64_t bc_kill_fh;
static off_t bc_kill_off;
static int bc_kill;

static char *bc_slot_payload(long slot)
{
    return bc_base + (size_t)slot * bc_stride + bc_payload;
}

/* A buffer to read the next request into: a slot from the pool, else a spare (NULL mem:
 * libfuse allocates one). */
static struct bc_request bc_buffer_get(void)
{
    struct bc_request r = {.slot = -1};
    pthread_mutex_lock(&bc_lock);
    if (bc_pool_n > 0) {
        r.slot = bc_pool[--bc_pool_n];
    } else if (bc_spares_n > 0) {
        r.buf.mem = bc_spares[--bc_spares_n];
    }
    pthread_mutex_unlock(&bc_lock);
    if (r.slot >= 0)
        r.buf.mem = bc_slot_payload(r.slot) - BC_WRITE_HEADER;
    return r;
}

static void bc_buffer_put(struct bc_request *r)
{
    pthread_mutex_lock(&bc_lock);
    if (r->slot >= 0) {
        bc_pool[bc_pool_n++] = r->slot; /* it came from the pool: there is room (above) */
    } else if (r->buf.mem != NULL) {
        if (bc_spares_n < BC_SPARES_MAX) {
            bc_spares[bc_spares_n++] = r->buf.mem;
            r->buf.mem = NULL;
        }
    }
    pthread_mutex_unlock(&bc_lock);
    free(r->slot >= 0 ? NULL : r->buf.mem);
}

/* Event loop: tops the pool up from hostd's staging (a Python call, so never the reader). */
static void bc_pool_fill(void)
{
    if (bc_base == NULL)
        return;
    for (;;) {
        pthread_mutex_lock(&bc_lock);
        int short_by = bc_pool_target - bc_pool_n;
        pthread_mutex_unlock(&bc_lock);
        if (short_by <= 0)
            return;
        long slot = bc_take_slot();
        if (slot < 0 || (size_t)slot >= bc_slots)
            return;
        pthread_mutex_lock(&bc_lock);
        bc_pool[bc_pool_n++] = slot; /* only this thread adds beyond what it took out */
        pthread_mutex_unlock(&bc_lock);
    }
}

/* Event loop: a processed request's slot back into the pool, unless the pool is full (0:
 * hostd takes it back). */
static int bc_pool_keep(long slot)
{
    pthread_mutex_lock(&bc_lock);
    int keep = bc_pool_n < bc_pool_target;
    if (keep)
        bc_pool[bc_pool_n++] = slot;
    pthread_mutex_unlock(&bc_lock);
    return keep;
}

static int bc_receive(struct fuse_session *se, struct bc_request *r)
{
    r->res = bc_real_receive(se, &r->buf);
    return r->res;
}

/* ---- the reader thread ---- */

#define BC_STOP_SIGNAL (SIGRTMIN + 5)

static void bc_on_stop_signal(int sig)
{
    (void)sig; /* only here to make the reader's read(2) return EINTR */
}

static void bc_queue_push(struct bc_request *r)
{
    pthread_mutex_lock(&bc_lock);
    while (bc_queue_n == BC_QUEUE && !bc_stopping)
        pthread_cond_wait(&bc_room, &bc_lock);
    if (bc_queue_n == BC_QUEUE) { /* stopping, and no room: drop it */
        pthread_mutex_unlock(&bc_lock);
        bc_buffer_put(r);
        return;
    }
    bc_queue[(bc_queue_head + bc_queue_n++) % BC_QUEUE] = *r;
    if (bc_queue_n == 1) {
        uint64_t one = 1; /* readable from empty to non-empty; cleared when emptied */
        while (write(bc_event_fd, &one, sizeof one) < 0 && errno == EINTR)
            ;
    }
    pthread_mutex_unlock(&bc_lock);
}

static void *bc_reader_main(void *arg)
{
    struct fuse_session *se = arg;
    sigset_t others;
    sigfillset(&others);
    sigdelset(&others, BC_STOP_SIGNAL); /* process signals are the event loop's business */
    pthread_sigmask(SIG_SETMASK, &others, NULL);
    for (;;) {
        pthread_mutex_lock(&bc_lock);
        int stopping = bc_stopping;
        pthread_mutex_unlock(&bc_lock);
        if (stopping)
            break;
        struct bc_request r = bc_buffer_get();
        int res = bc_receive(se, &r);
        if (res == -EINTR || res == -EAGAIN) {
            bc_buffer_put(&r);
            continue;
        }
        /* res 0: the session ended (libfuse set its exit flag, e.g. ENODEV on unmount);
         * res < 0: a read error. Either goes to the event loop, which ends its loop. */
        bc_queue_push(&r);
        if (res <= 0)
            break;
    }
    pthread_mutex_lock(&bc_lock);
    bc_reader_running = 0;
    pthread_mutex_unlock(&bc_lock);
    return NULL;
}

static int bc_reader_start(struct fuse_session *se)
{
    struct sigaction sa = {.sa_handler = bc_on_stop_signal}; /* no SA_RESTART: EINTR */
    sigemptyset(&sa.sa_mask);
    bc_event_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (bc_event_fd < 0 || sigaction(BC_STOP_SIGNAL, &sa, NULL) != 0)
        return -1;
    bc_reader_running = 1;
    if (pthread_create(&bc_reader, NULL, bc_reader_main, se) != 0) {
        bc_reader_running = 0;
        return -1;
    }
    bc_reader_joinable = 1;
    return 0;
}

/* Ends the reader before libfuse unmounts or frees the session; returns 0 once it has. Usually
 * it already has (an unmount ends its read with ENODEV); else its read is interrupted. */
static int bc_reader_stop(void)
{
    if (!bc_reader_joinable)
        return 0;
    pthread_mutex_lock(&bc_lock);
    bc_stopping = 1;
    pthread_cond_broadcast(&bc_room);
    pthread_mutex_unlock(&bc_lock);
    for (int tries = 0; tries < 200; tries++) { /* ~2 s */
        pthread_mutex_lock(&bc_lock);
        int running = bc_reader_running;
        pthread_mutex_unlock(&bc_lock);
        if (!running) {
            pthread_join(bc_reader, NULL);
            bc_reader_joinable = 0;
            return 0;
        }
        pthread_kill(bc_reader, BC_STOP_SIGNAL);
        usleep(10000);
    }
    return -1;
}

/* ---- passthrough and max_pages (see the top) ---- */

/* The kernel's FUSE ABI as of protocol 7.45 (include/uapi/linux/fuse.h), where it goes past
 * the 7.38 headers this is built against. */
#define BC_OP_OPEN 14
#define BC_OP_INIT 26
#define BC_OP_CREATE 35
#define BC_ENTRY_OUT 128 /* sizeof(struct fuse_entry_out), before a CREATE's fuse_open_out */
#define BC_INIT_WRITEBACK_CACHE (1u << 16)
#define BC_INIT_MAX_PAGES (1u << 22)
#define BC_INIT_EXT (1u << 30)
#define BC_INIT2_PASSTHROUGH (1u << 5) /* FUSE_PASSTHROUGH: bit 37 of the 64-bit flags */
#define BC_INIT2_REQUEST_TIMEOUT (1u << 10) /* FUSE_REQUEST_TIMEOUT: bit 42 (7.43+) */
#define BC_INIT2_DIRECT_IO_ALLOW_MMAP (1u << 4) /* FUSE_DIRECT_IO_ALLOW_MMAP: bit 36 (7.39+) */
#define BC_FOPEN_DIRECT_IO (1u << 0)
#define BC_FOPEN_KEEP_CACHE (1u << 1)
#define BC_FOPEN_NOFLUSH (1u << 5)
#define BC_FOPEN_PASSTHROUGH (1u << 7)

struct bc_in_header {
    uint32_t len, opcode;
    uint64_t unique, nodeid;
    uint32_t uid, gid, pid;
    uint16_t total_extlen, padding;
};
struct bc_out_header {
    uint32_t len;
    int32_t error;
    uint64_t unique;
};
struct bc_init_in {
    uint32_t major, minor, max_readahead, flags, flags2, unused[11];
};
struct bc_init_out {
    uint32_t major, minor, max_readahead, flags;
    uint16_t max_background, congestion_threshold;
    uint32_t max_write, time_gran;
    uint16_t max_pages, map_alignment;
    uint32_t flags2, max_stack_depth;
    uint16_t request_timeout, unused[11];
};
struct bc_open_in {
    uint32_t flags, open_flags;
};
struct bc_open_out {
    uint64_t fh;
    uint32_t open_flags;
    int32_t backing_id;
};
struct bc_backing_map {
    int32_t fd;
    uint32_t flags;
    uint64_t padding;
};
_Static_assert(sizeof(struct bc_in_header) == 40, "fuse_in_header is 40 bytes");
_Static_assert(sizeof(struct bc_out_header) == 16, "fuse_out_header is 16 bytes");
_Static_assert(sizeof(struct bc_init_in) == 64, "fuse_init_in is 64 bytes");
_Static_assert(sizeof(struct bc_init_out) == 64, "fuse_init_out is 64 bytes");
_Static_assert(offsetof(struct bc_init_out, max_stack_depth) == 36, "max_stack_depth at 36");
_Static_assert(sizeof(struct bc_open_out) == 16, "fuse_open_out is 16 bytes");
_Static_assert(sizeof(struct bc_backing_map) == 16, "fuse_backing_map is 16 bytes");
#define BC_DEV_IOC_BACKING_OPEN _IOW(229, 1, struct bc_backing_map)
#define BC_DEV_IOC_BACKING_CLOSE _IOW(229, 2, uint32_t)

/* OPEN and CREATE requests read and not yet answered, and the handles hostd gave a backing id to whose
 * OPEN reply has not gone yet. Both are short-lived: a linear scan is enough. Under bc_pt_lock
 * (the reader thread reads, the event loop and pyfuse3's notify thread write). */
#define BC_PENDING_MAX 1024
#define BC_BACKED_MAX 1024
/* Who does a backed handle's I/O (bc_passthrough_set's `mode`; build_fuse_shim.py too). */
#define BC_PT_KERNEL_READS 0  /* read-only: the kernel reads the backing file */
#define BC_PT_DAEMON_IO 1     /* FOPEN_DIRECT_IO kept: reads and writes reach the server */
#define BC_PT_KERNEL_WRITES 2 /* the kernel reads and writes the backing file; FLUSH kept */
struct bc_backed {
    uint64_t fh;
    int32_t backing_id;
    int mode; /* BC_PT_* */
    int used;
};
static pthread_mutex_t bc_pt_lock = PTHREAD_MUTEX_INITIALIZER;
struct bc_pending_open {
    uint64_t unique;
    int read_only; /* an OPEN for reading only: its reply gets FOPEN_NOFLUSH */
};
static struct bc_pending_open bc_pending[BC_PENDING_MAX];
static int bc_pending_n;
static struct bc_backed bc_backed[BC_BACKED_MAX];
static uint64_t bc_init_unique;
static uint32_t bc_init_flags, bc_init_flags2; /* what the kernel offered */
static int bc_init_seen;

static int bc_want_passthrough, bc_want_max_pages; /* bc_negotiate() */
static int bc_want_request_timeout;                /* bc_negotiate_request_timeout() */
static int bc_request_timeout_negotiated = -1;     /* seconds; 0 not offered; -1 not yet */
static int bc_shared_mmap_negotiated = -1;         /* 1 yes, 0 not offered, -1 not yet */
static int bc_io_installed;
static int bc_dev_fd = -1;
/* What the INIT reply said: -1 not yet, 0 no, 1 yes; max_pages 0 until then. */
static int bc_passthrough_negotiated = -1;
static int bc_max_pages_negotiated;
static int bc_init_minor;
static unsigned long long bc_passthrough_replies, bc_backings_opened, bc_backings_closed;

static ssize_t bc_io_read(int fd, void *buf, size_t len, void *userdata)
{
    (void)userdata;
    ssize_t res = read(fd, buf, len);
    if (res < (ssize_t)sizeof(struct bc_in_header))
        return res;
    struct bc_in_header in;
    memcpy(&in, buf, sizeof in);
    if (in.opcode == BC_OP_INIT &&
        res >= (ssize_t)(sizeof in + offsetof(struct bc_init_in, unused))) {
        struct bc_init_in init;
        memcpy(&init, (char *)buf + sizeof in, offsetof(struct bc_init_in, unused));
        pthread_mutex_lock(&bc_pt_lock);
        bc_init_unique = in.unique;
        bc_init_flags = init.flags;
        bc_init_flags2 = (init.flags & BC_INIT_EXT) ? init.flags2 : 0;
        bc_init_minor = (int)init.minor;
        bc_init_seen = 1;
        pthread_mutex_unlock(&bc_pt_lock);
    } else if (in.opcode == BC_OP_OPEN || in.opcode == BC_OP_CREATE) {
        int read_only = 0;
        if (in.opcode == BC_OP_OPEN && res >= (ssize_t)(sizeof in + sizeof(struct bc_open_in))) {
            struct bc_open_in open;
            memcpy(&open, (char *)buf + sizeof in, sizeof open);
            read_only = (open.flags & O_ACCMODE) == O_RDONLY && !(open.flags & O_TRUNC);
        }
        pthread_mutex_lock(&bc_pt_lock);
        if (bc_pending_n < BC_PENDING_MAX) /* else its reply goes as libfuse made it */
            bc_pending[bc_pending_n++] = (struct bc_pending_open){in.unique, read_only};
        pthread_mutex_unlock(&bc_pt_lock);
    }
    return res;
}

/* Whether `unique` is an OPEN or CREATE awaiting its reply (0 no, 1 yes, 2 an OPEN for
 * reading only); takes it off the list. bc_pt_lock held. */
static int bc_take_pending(uint64_t unique)
{
    for (int i = 0; i < bc_pending_n; i++) {
        if (bc_pending[i].unique == unique) {
            int read_only = bc_pending[i].read_only;
            bc_pending[i] = bc_pending[--bc_pending_n];
            return read_only ? 2 : 1;
        }
    }
    return 0;
}

/* The INIT reply, as the kernel offered (bc_pt_lock held). The kernel ignores FUSE_PASSTHROUGH
 * next to FUSE_WRITEBACK_CACHE (fs/fuse/inode.c, process_init_reply), so it is not asked for
 * then; max_write stays libfuse's: its request buffer is sized for it. */
static void bc_patch_init(struct bc_init_out *out)
{
    bc_passthrough_negotiated = 0;
    if (bc_want_passthrough && (bc_init_flags & BC_INIT_EXT) &&
        (bc_init_flags2 & BC_INIT2_PASSTHROUGH) && !(out->flags & BC_INIT_WRITEBACK_CACHE)) {
        out->flags |= BC_INIT_EXT;
        out->flags2 |= BC_INIT2_PASSTHROUGH;
        out->max_stack_depth = 1; /* a memfd's file system stacks on nothing */
        bc_passthrough_negotiated = 1;
    }
    if (bc_want_max_pages > 0 && (bc_init_flags & BC_INIT_MAX_PAGES)) {
        out->flags |= BC_INIT_MAX_PAGES;
        out->max_pages = (uint16_t)bc_want_max_pages;
    }
    bc_max_pages_negotiated = (out->flags & BC_INIT_MAX_PAGES) ? out->max_pages : 32;
    /* Every handle hostd answers is FOPEN_DIRECT_IO, and of such a file the kernel refuses a
     * shared mapping (MAP_SHARED: Python's mmap, numpy.memmap, safetensors) with ENODEV
     * unless this was negotiated (fs/fuse/file.c, fuse_file_mmap). With it, the mapping
     * reads and writes through the page cache and puts the inode in caching io mode until
     * that handle's release; the kernel then refuses a passthrough open of the inode
     * (fs/fuse/iomode.c), and fusefs/passthrough.py answers none while a handle without a
     * backing is open. A handle with a backing maps its memfd, as before. */
    bc_shared_mmap_negotiated = 0;
    if ((bc_init_flags & BC_INIT_EXT) && (bc_init_flags2 & BC_INIT2_DIRECT_IO_ALLOW_MMAP)) {
        out->flags |= BC_INIT_EXT;
        out->flags2 |= BC_INIT2_DIRECT_IO_ALLOW_MMAP;
        bc_shared_mmap_negotiated = 1;
    }
    /* The kernel's request timeout (6.14+): a request this daemon leaves unanswered that long
     * makes the kernel abort the connection (fs/fuse/dev.c), so a caller never waits for a
     * stopped hostd for ever. Offered in the INIT request's flags2 where the kernel has it. */
    bc_request_timeout_negotiated = 0;
    if (bc_want_request_timeout > 0 && (bc_init_flags & BC_INIT_EXT) &&
        (bc_init_flags2 & BC_INIT2_REQUEST_TIMEOUT)) {
        out->flags |= BC_INIT_EXT;
        out->flags2 |= BC_INIT2_REQUEST_TIMEOUT;
        out->request_timeout = (uint16_t)bc_want_request_timeout;
        bc_request_timeout_negotiated = bc_want_request_timeout;
    }
}

/* The fuse_open_out of an OPEN or CREATE reply for a handle with a backing id (bc_pt_lock held): FOPEN_PASSTHROUGH with that
 * id. The kernel refuses (EIO) FOPEN_KEEP_CACHE beside it (fs/fuse/iomode.c,
 * FOPEN_PASSTHROUGH_MASK); FOPEN_DIRECT_IO beside it sends reads and writes to the server and
 * only mmap to the backing file. Returns 1 if it changed the reply. */
static int bc_patch_open(struct bc_open_out *out)
{
    for (int i = 0; i < BC_BACKED_MAX; i++) {
        struct bc_backed *b = &bc_backed[i];
        if (!b->used || b->fh != out->fh)
            continue;
        out->open_flags |= BC_FOPEN_PASSTHROUGH;
        out->open_flags &= ~BC_FOPEN_KEEP_CACHE;
        if (b->mode != BC_PT_DAEMON_IO)
            out->open_flags &= ~BC_FOPEN_DIRECT_IO;
        out->backing_id = b->backing_id;
        b->used = 0; /* one reply per registration */
        bc_passthrough_replies++;
        return 1;
    }
    return 0;
}

static ssize_t bc_io_writev(int fd, struct iovec *iov, int count, void *userdata)
{
    (void)userdata;
    struct bc_out_header out;
    if (count < 1 || count > 2 || iov[0].iov_len != sizeof out)
        return writev(fd, iov, count);
    memcpy(&out, iov[0].iov_base, sizeof out);
    /* An error reply is the header alone (count 1). It ends an INIT or an OPEN as a reply
     * with an argument does, so it goes through the same bookkeeping: an OPEN left on the
     * list held its slot for good, and once the list was full no open was given its backing
     * any more. Only a reply with an argument is patched. */
    size_t len = count == 2 ? iov[1].iov_len : 0;
    union {
        struct bc_init_out init;
        char open[BC_ENTRY_OUT + sizeof(struct bc_open_out)]; /* CREATE's; OPEN's is its tail */
    } arg;
    struct iovec patched[2] = {iov[0], {&arg, len}};
    int changed = 0, pending;
    pthread_mutex_lock(&bc_pt_lock);
    if (bc_init_seen && out.unique == bc_init_unique) {
        bc_init_seen = 0;
        if (out.error == 0 && len == sizeof arg.init) {
            memcpy(&arg.init, iov[1].iov_base, sizeof arg.init);
            bc_patch_init(&arg.init);
            changed = 1;
        } else {
            bc_passthrough_negotiated = 0;
        }
    } else if (bc_pending_n > 0 && (pending = bc_take_pending(out.unique)) && out.error == 0 &&
               (len == sizeof(struct bc_open_out) || len == sizeof arg.open)) {
        struct bc_open_out open;
        memcpy(arg.open, iov[1].iov_base, len);
        memcpy(&open, arg.open + len - sizeof open, sizeof open);
        changed = bc_patch_open(&open);
        if (pending == 2) {
            /* Opened for reading only: close(2) need not wait for a FLUSH round trip
             * through both daemons (0.25-0.27 ms of each NVMe hit's 12.7-16.6 ms on the
             * 2-core benchmark VM, kernel timeline). Such a handle has nothing to flush, and locks
             * are the kernel's own here (no lock operations). RELEASE still comes,
             * asynchronously. A writer keeps its FLUSH: the cache takes in a kernel
             * writer's size there, and reports a refused write, before close(2) returns. */
            open.open_flags |= BC_FOPEN_NOFLUSH;
            changed = 1;
        }
        memcpy(arg.open + len - sizeof open, &open, sizeof open);
    }
    pthread_mutex_unlock(&bc_pt_lock);
    return writev(fd, changed ? patched : iov, count);
}

typedef int (*bc_mount_fn)(struct fuse_session *, const char *);
typedef int (*bc_custom_io_fn)(struct fuse_session *, const struct fuse_custom_io *, int);

/* pyfuse3.init mounts with this: then the custom io goes on the fd libfuse opened. */
__attribute__((visibility("default")))
int fuse_session_mount(struct fuse_session *se, const char *mountpoint)
{
    bc_mount_fn real = (bc_mount_fn)bc_libfuse("fuse_session_mount");
    bc_custom_io_fn custom_io = (bc_custom_io_fn)bc_libfuse("fuse_session_custom_io");
    bc_fd_fn session_fd = (bc_fd_fn)bc_libfuse("fuse_session_fd");
    if (real == NULL)
        return -1;
    int res = real(se, mountpoint);
    /* Installed whatever was negotiated: every open for reading only is given FOPEN_NOFLUSH
     * (bc_io_writev). */
    if (res != 0 || custom_io == NULL || session_fd == NULL)
        return res;
    static const struct fuse_custom_io io = {.writev = bc_io_writev, .read = bc_io_read};
    int fd = session_fd(se);
    if (custom_io(se, &io, fd) == 0) {
        bc_io_installed = 1;
        bc_dev_fd = fd;
    }
    return res;
}

/* Before pyfuse3.init: ask the kernel for passthrough (0/1) and for `max_pages` pages per
 * request (0: as libfuse asks). Returns 0, or -1 where the shim does not serve pyfuse3. */
int bc_negotiate(int passthrough, int max_pages)
{
    if (bc_state == -1 || max_pages < 0 || max_pages > 65535)
        return -1;
    bc_want_passthrough = passthrough;
    bc_want_max_pages = max_pages;
    return 0;
}

/* Before pyfuse3.init: ask the kernel to abort the connection when a request waits for an
 * answer longer than `seconds` (1..65535; 0: do not ask). Returns 0, or -1 where the shim
 * does not serve pyfuse3 or the value is out of range. */
int bc_negotiate_request_timeout(int seconds)
{
    if (bc_state == -1 || seconds < 0 || seconds > 65535)
        return -1;
    bc_want_request_timeout = seconds;
    return 0;
}

/* After the INIT reply: the request timeout negotiated in seconds, 0 where the kernel did not
 * offer FUSE_REQUEST_TIMEOUT or none was asked, -1 INIT not answered (yet) or no custom io. */
int bc_request_timeout_state(void)
{
    pthread_mutex_lock(&bc_pt_lock);
    int state = bc_io_installed ? bc_request_timeout_negotiated : -1;
    pthread_mutex_unlock(&bc_pt_lock);
    return state;
}

/* After the INIT reply: 1 shared mappings of direct_io files allowed, 0 not offered by the
 * kernel, -1 INIT not answered (yet) or no custom io. */
int bc_shared_mmap_state(void)
{
    pthread_mutex_lock(&bc_pt_lock);
    int state = bc_io_installed ? bc_shared_mmap_negotiated : -1;
    pthread_mutex_unlock(&bc_pt_lock);
    return state;
}

/* After the INIT reply: 1 passthrough negotiated, 0 not, -1 INIT not answered (yet) or the
 * custom io not installed. */
int bc_passthrough_state(void)
{
    pthread_mutex_lock(&bc_pt_lock);
    int state = bc_io_installed ? bc_passthrough_negotiated : -1;
    pthread_mutex_unlock(&bc_pt_lock);
    return state;
}

/* Pages per request the INIT reply allowed (0 before it, or without the custom io). */
int bc_max_pages(void)
{
    pthread_mutex_lock(&bc_pt_lock);
    int pages = bc_io_installed ? bc_max_pages_negotiated : 0;
    pthread_mutex_unlock(&bc_pt_lock);
    return pages;
}

/* The protocol minor the kernel offered in INIT (0 before it). */
int bc_kernel_minor(void)
{
    pthread_mutex_lock(&bc_pt_lock);
    int minor = bc_init_minor;
    pthread_mutex_unlock(&bc_pt_lock);
    return minor;
}

/* A backing id for `fd` (FUSE_DEV_IOC_BACKING_OPEN: needs CAP_SYS_ADMIN), or -errno. The
 * kernel holds its own reference to the file from here on. */
int bc_backing_open(int fd)
{
    struct bc_backing_map map = {.fd = fd};
    if (bc_dev_fd < 0 || bc_passthrough_state() != 1)
        return -ENOTCONN;
    int id = ioctl(bc_dev_fd, BC_DEV_IOC_BACKING_OPEN, &map);
    if (id < 0)
        return -errno;
    __atomic_add_fetch(&bc_backings_opened, 1, __ATOMIC_RELAXED);
    return id;
}

/* Gives a backing id back (opens still using it keep the file); 0 or -errno. */
int bc_backing_close(int backing_id)
{
    uint32_t id = (uint32_t)backing_id;
    if (bc_dev_fd < 0)
        return -ENOTCONN;
    if (ioctl(bc_dev_fd, BC_DEV_IOC_BACKING_CLOSE, &id) != 0)
        return -errno;
    __atomic_add_fetch(&bc_backings_closed, 1, __ATOMIC_RELAXED);
    return 0;
}

/* The OPEN reply for handle `fh` carries FOPEN_PASSTHROUGH and `backing_id`; `mode` says
 * who does its reads and writes (BC_PT_*: the kernel's reads, the daemon's I/O with
 * FOPEN_DIRECT_IO kept, or the kernel's reads and writes). Call before the open's reply; 0,
 * or -1 if full. */
int bc_passthrough_set(uint64_t fh, int backing_id, int mode)
{
    int res = -1;
    pthread_mutex_lock(&bc_pt_lock);
    for (int i = 0; i < BC_BACKED_MAX; i++) {
        if (!bc_backed[i].used || bc_backed[i].fh == fh) {
            bc_backed[i] = (struct bc_backed){fh, backing_id, mode, 1};
            res = 0;
            break;
        }
    }
    pthread_mutex_unlock(&bc_pt_lock);
    return res;
}

/* Forgets a registration whose reply never went (a failed open). */
void bc_passthrough_clear(uint64_t fh)
{
    pthread_mutex_lock(&bc_pt_lock);
    for (int i = 0; i < BC_BACKED_MAX; i++)
        if (bc_backed[i].used && bc_backed[i].fh == fh)
            bc_backed[i].used = 0;
    pthread_mutex_unlock(&bc_pt_lock);
}

/* Counters for hostd's stats and the tests: OPEN replies given FOPEN_PASSTHROUGH, backing ids
 * opened, closed. */
unsigned long long bc_passthrough_opens(void)
{
    pthread_mutex_lock(&bc_pt_lock);
    unsigned long long n = bc_passthrough_replies;
    pthread_mutex_unlock(&bc_pt_lock);
    return n;
}

unsigned long long bc_backings_opened_count(void)
{
    return __atomic_load_n(&bc_backings_opened, __ATOMIC_RELAXED);
}

unsigned long long bc_backings_closed_count(void)
{
    return __atomic_load_n(&bc_backings_closed, __ATOMIC_RELAXED);
}

/* ---- libfuse entry points ---- */

static void bc_init(void *userdata, struct fuse_conn_info *conn)
{
    if (bc_pyfuse3_init)
        bc_pyfuse3_init(userdata, conn);
    /* libfuse turns splice on for any write_buf handler; a request must be read(2) into the
     * slot instead (a splice would leave the payload in a pipe). */
    conn->want &= ~FUSE_CAP_SPLICE_READ;
}

/* Whether a write carries FUSE_WRITE_KILL_SUIDGID. libfuse points the payload just past the
 * request's fuse_write_in (do_write_buf: PARAM(arg)); its fh and offset must match. */
static int bc_write_kills(const struct fuse_bufvec *bufv, uint64_t fh, off_t off)
{
    const struct fuse_buf *b = &bufv->buf[0];
    struct bc_write_in in;
    if (bufv->count < 1 || bufv->idx != 0 || bufv->off != 0 || (b->flags & FUSE_BUF_IS_FD) ||
        b->mem == NULL)
        return 0;
    memcpy(&in, (const char *)b->mem - sizeof in, sizeof in);
    return in.fh == fh && in.offset == (uint64_t)off && (in.write_flags & BC_WRITE_KILL_SUIDGID);
}

static void bc_write_buf(fuse_req_t req, fuse_ino_t ino, struct fuse_bufvec *bufv, off_t off,
                         struct fuse_file_info *fi)
{
    const struct fuse_buf *b = &bufv->buf[0];
    bc_kill_fh = fi->fh;
    bc_kill_off = off;
    bc_kill = bc_write_kills(bufv, fi->fh, off);
    if (bc_current_slot >= 0 && bufv->count == 1 && bufv->idx == 0 &&
        !(b->flags & FUSE_BUF_IS_FD) &&
        (char *)b->mem + bufv->off == bc_slot_payload(bc_current_slot)) {
        long slot = bc_current_slot;
        bc_current_slot = -1; /* Python owns it now */
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
    bc_session_new_fn real = (bc_session_new_fn)bc_libfuse("fuse_session_new");
    bc_real_receive = (bc_receive_fn)bc_libfuse("fuse_session_receive_buf");
    if (real == NULL)
        return NULL;
    if (op_size > sizeof(bc_patched_ops) || bc_real_receive == NULL) {
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

/* pyfuse3 asks once, right after mounting, for the fd to wait on: with the reader thread,
 * the eventfd of its queue (and this is where the reader starts: the session is mounted). */
__attribute__((visibility("default")))
int fuse_session_fd(struct fuse_session *se)
{
    static bc_fd_fn real;
    if (real == NULL)
        real = (bc_fd_fn)bc_libfuse("fuse_session_fd");
    if (real == NULL)
        return -1;
    if (!bc_want_reader || bc_state != 1 || bc_pyfuse3_write_buf == NULL)
        return real(se);
    if (bc_event_fd < 0 && bc_reader_start(se) != 0) {
        bc_want_reader = 0; /* hostd sees bc_reader_state() 0 and says so */
        if (bc_event_fd >= 0)
            close(bc_event_fd);
        bc_event_fd = -1;
        return real(se);
    }
    return bc_event_fd;
}

__attribute__((visibility("default")))
int fuse_session_receive_buf(struct fuse_session *se, struct fuse_buf *buf)
{
    if (bc_real_receive == NULL)
        bc_real_receive = (bc_receive_fn)bc_libfuse("fuse_session_receive_buf");
    if (bc_real_receive == NULL)
        return -ENOSYS;
    if (bc_pyfuse3_write_buf == NULL || (bc_base == NULL && !bc_reader_joinable))
        return bc_real_receive(se, buf);
    bc_pool_fill();
    struct bc_request r;
    if (bc_reader_joinable) {
        pthread_mutex_lock(&bc_lock);
        if (bc_queue_n == 0) { /* woken for nothing: pyfuse3 waits again on EINTR */
            uint64_t n;
            (void)!read(bc_event_fd, &n, sizeof n);
            pthread_mutex_unlock(&bc_lock);
            return -EINTR;
        }
        r = bc_queue[bc_queue_head];
        bc_queue_head = (bc_queue_head + 1) % BC_QUEUE;
        if (--bc_queue_n == 0) {
            uint64_t n;
            (void)!read(bc_event_fd, &n, sizeof n);
        }
        pthread_cond_signal(&bc_room);
        pthread_mutex_unlock(&bc_lock);
    } else {
        r = bc_buffer_get();
        bc_receive(se, &r);
    }
    if (r.res <= 0) {
        bc_buffer_put(&r);
        return r.res;
    }
    bc_current = r;
    bc_current_for = buf;
    /* pyfuse3 looks at nothing but the result; its own buffer stays as it was (it frees it
     * when the worker ends). */
    return r.res;
}

__attribute__((visibility("default")))
void fuse_session_process_buf(struct fuse_session *se, const struct fuse_buf *buf)
{
    static bc_process_fn real;
    if (real == NULL)
        real = (bc_process_fn)bc_libfuse("fuse_session_process_buf");
    if (real == NULL)
        return;
    if (bc_current_for == NULL || buf != bc_current_for) {
        real(se, buf);
        return;
    }
    struct bc_request r = bc_current;
    bc_current_for = NULL;
    bc_current_slot = r.slot;
    real(se, &r.buf);
    if (r.slot >= 0 && bc_current_slot < 0)
        return; /* a write handed the slot to Python */
    bc_current_slot = -1;
    if (r.slot < 0)
        bc_buffer_put(&r);
    else if (!bc_pool_keep(r.slot))
        bc_give_slot(r.slot); /* not hoarded: hostd's reads and writes need slots too */
}

/* Requests read but never processed: their buffers return (slots to the pool, for hostd). */
static void bc_drop_queue(void)
{
    pthread_mutex_lock(&bc_lock);
    while (bc_queue_n > 0) {
        struct bc_request r = bc_queue[bc_queue_head];
        bc_queue_head = (bc_queue_head + 1) % BC_QUEUE;
        bc_queue_n--;
        pthread_mutex_unlock(&bc_lock);
        bc_buffer_put(&r);
        pthread_mutex_lock(&bc_lock);
    }
    pthread_mutex_unlock(&bc_lock);
}

/* pyfuse3.close() unmounts (unless the kernel ended the session already), then destroys the
 * session. The reader must be gone before either: libfuse's unmount closes the /dev/fuse fd,
 * whose number a reader still looping could then read from once reused. */
__attribute__((visibility("default")))
void fuse_session_unmount(struct fuse_session *se)
{
    static bc_session_fn real;
    if (real == NULL)
        real = (bc_session_fn)bc_libfuse("fuse_session_unmount");
    if (bc_reader_stop() != 0)
        return; /* the reader still reads: leave the mount to hostd's own unmount */
    bc_dev_fd = -1; /* libfuse closes it: its number may be reused */
    if (real != NULL)
        real(se);
}

__attribute__((visibility("default")))
void fuse_session_destroy(struct fuse_session *se)
{
    static bc_session_fn real;
    if (real == NULL)
        real = (bc_session_fn)bc_libfuse("fuse_session_destroy");
    if (bc_reader_stop() != 0)
        return; /* the reader still uses the session: leave it (hostd is exiting) */
    bc_drop_queue();
    pthread_mutex_lock(&bc_lock);
    for (int i = 0; i < bc_spares_n; i++)
        free(bc_spares[i]);
    bc_spares_n = 0;
    pthread_mutex_unlock(&bc_lock);
    if (bc_event_fd >= 0)
        close(bc_event_fd);
    bc_event_fd = -1;
    bc_dev_fd = -1;
    if (real != NULL)
        real(se);
}

int bc_shim_state(void)
{
    return bc_state;
}

/* Before pyfuse3.init: read /dev/fuse in a thread of this library (see the top). Returns 0,
 * or -1 where the shim does not serve pyfuse3 (nothing changes then). */
int bc_use_reader_thread(void)
{
    if (bc_state == -1)
        return -1;
    bc_want_reader = 1;
    return 0;
}

/* 1 while the reader thread reads for pyfuse3, 0 if it never started (or has ended). */
int bc_reader_state(void)
{
    pthread_mutex_lock(&bc_lock);
    int running = bc_reader_running;
    pthread_mutex_unlock(&bc_lock);
    return running;
}

/* Reads requests into hostd's staging from now on (see the top of this file). The map is
 * `slots` strides of `stride` bytes; a slot's payload starts `payload` bytes into its stride.
 * Returns 0, or -1 if the shim cannot do it (libfuse did not call it, or a read could run
 * past the slot's stride). Event loop only. */
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
    bc_pool_target = bc_reader_joinable ? BC_QUEUE + 2 : 2;
    bc_base = base;
    return 0;
}

/* Back to pyfuse3's buffers: returns one slot the shim held (or -1 when it holds none), for
 * hostd to call until -1. Called once the session has ended (pyfuse3.close). */
long bc_receive_stop(void)
{
    bc_base = NULL;
    long slot = -1;
    pthread_mutex_lock(&bc_lock);
    if (bc_pool_n > 0)
        slot = bc_pool[--bc_pool_n];
    pthread_mutex_unlock(&bc_lock);
    return slot;
}

/* 1 if the write to (fh, off) being handed to Python now (in place, or by pyfuse3 before its
 * handler's first await) asks to clear S_ISUID/S_ISGID; answered once. */
int bc_take_write_kill(uint64_t fh, off_t off)
{
    int kill = bc_kill && bc_kill_fh == fh && bc_kill_off == off;
    bc_kill = 0;
    return kill;
}

unsigned long long bc_writes_in_place(void)
{
    return bc_in_place;
}

unsigned long long bc_writes_copied(void)
{
    return bc_copied;
}
