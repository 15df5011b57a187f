/*
 * CUDA driver API simulator: a libcuda.so.1 with the driver calls bluecache makes, on plain
 * Linux, so the CUDA IPC path of the zero-copy ioctl runs end to end where no GPU is lent.
 * NOTHING here touches a GPU: "device memory" is a memfd and a "copy engine" is memcpy. It is
 * built only by the tests and bench/gpu_bench.py (native/build_cuda_sim.py), never packaged,
 * and loaded in place of the real driver by soname. What it keeps of the documented driver
 * semantics, because a caller can get them wrong:
 *
 *  - cuInit first (CUDA_ERROR_NOT_INITIALIZED); a stack of current contexts per thread
 *    (cuCtxSetCurrent replaces its top, cuCtxPushCurrent/cuCtxPopCurrent): a thread with none
 *    gets CUDA_ERROR_INVALID_CONTEXT from every call that needs one, as on hardware.
 *    cuPointerGetAttribute (CONTEXT, DEVICE_ORDINAL) needs none: it is how a thread finds the
 *    context of a device pointer it was handed; for any address that is not in a device
 *    allocation it gives CUDA_ERROR_INVALID_VALUE (registered host memory is not modelled).
 *  - unified addressing: a device pointer is an address in the process's own address space,
 *    reserved PROT_NONE, so the CPU faults on it as it does on a real device pointer; the bytes
 *    live in a separate mapping only this library touches.
 *  - copies check that the device span lies inside one allocation (CUDA_ERROR_INVALID_VALUE).
 *  - asynchronous copies on a stream are queued and done only when the stream (or the context)
 *    is synchronised or destroyed: a caller that reads the bytes without waiting sees stale
 *    ones, as it might on hardware. The NULL stream and the two default-stream handles
 *    (CU_STREAM_LEGACY 0x1, CU_STREAM_PER_THREAD 0x2) copy at once; any other stream must be
 *    one cuStreamCreate made and not yet destroyed (CUDA_ERROR_INVALID_HANDLE).
 *  - IPC: cuIpcGetMemHandle wants an allocation's base; the 64-byte handle names the exporting
 *    process, its memfd and a random tag. cuIpcOpenMemHandle in another process takes that
 *    memfd with pidfd_getfd (needs ptrace rights over the exporter, as the DOCA simulator
 *    does) and checks the tag, so a handle of freed memory is refused even when the fd number
 *    was reused. Opening in the exporting process: CUDA_ERROR_INVALID_CONTEXT. Opening a
 *    handle twice in one process returns the same pointer and counts references.
 *  - cuMemHostRegister refuses overlapping ranges (..._ALREADY_REGISTERED), unregistering an
 *    unknown one gives ..._NOT_REGISTERED.
 *  - cuMemGetHandleForAddressRange: CUDA_ERROR_NOT_SUPPORTED (no dma-buf can come from here).
 *
 * The library is found by cuda-python through cuGetProcAddress_v2, which hands out the newest
 * ABI of each call (the _v2 variants, 64-bit CUdeviceptr). Environment: CUDA_SIM_DEVICES
 * (default 1).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct sim_context *CUcontext;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct sim_stream *CUstream;

enum {
	CUDA_SUCCESS = 0,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_OUT_OF_MEMORY = 2,
	CUDA_ERROR_NOT_INITIALIZED = 3,
	CUDA_ERROR_NO_DEVICE = 100,
	CUDA_ERROR_INVALID_DEVICE = 101,
	CUDA_ERROR_INVALID_CONTEXT = 201,
	CUDA_ERROR_MAP_FAILED = 205,
	CUDA_ERROR_INVALID_HANDLE = 400,
	CUDA_ERROR_NOT_FOUND = 500,
	CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
	CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
	CUDA_ERROR_NOT_SUPPORTED = 801,
};

static const struct { CUresult code; const char *name, *text; } errors[] = {
	{CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
	{CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
	{CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
	{CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
	{CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
	{CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
	{CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
	{CUDA_ERROR_MAP_FAILED, "CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed"},
	{CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
	{CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
	{CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
	 "part or all of the requested memory range is already mapped"},
	{CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
	 "pointer does not correspond to a registered memory region"},
	{CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
};

#define HANDLE_MAGIC 0x4d49534144554342ULL /* "BCUDASIM" */

struct handle_bytes {          /* the layout inside CUipcMemHandle.reserved */
	uint64_t magic;
	int32_t pid;
	int32_t fd;
	uint64_t tag;
	uint64_t size;
	char unused[32];
};

struct sim_context { CUdevice device; int retained; };

/* One device allocation, made here (cuMemAlloc) or opened from a peer (cuIpcOpenMemHandle). */
struct allocation {
	CUdeviceptr address;   /* PROT_NONE reservation: what callers see */
	size_t size;
	char *bytes;           /* the memfd's shared mapping: what copies touch */
	int fd;                /* the memfd (ours, or taken from the peer) */
	uint64_t tag;
	int opened_ipc;        /* 1: from cuIpcOpenMemHandle */
	int references;        /* IPC opens of the same handle */
	int32_t peer_pid;
	CUcontext context;     /* current when it was allocated or opened */
	struct allocation *next;
};

struct host_range { char *start; size_t size; int pinned_alloc; struct host_range *next; };

struct pending_copy {
	CUdeviceptr device;
	void *host;
	size_t n;
	int to_host;
	struct pending_copy *next;
};

struct sim_stream {
	struct pending_copy *head, **tail;
	struct sim_stream *next;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized, device_count = 1;
static struct sim_context *primary;          /* one per device, made by cuInit */
static struct allocation *allocations;
static struct host_range *host_ranges;
static struct sim_stream *streams;
static __thread CUcontext current;          /* the top of this thread's context stack */
static __thread CUcontext below[16];         /* the rest of it, cuCtxPushCurrent's */
static __thread int depth;

static CUresult need_context(void)
{
	if (!initialized)
		return CUDA_ERROR_NOT_INITIALIZED;
	return current ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

/* Under lock: the allocation holding [address, address + n), if one holds all of it. */
static struct allocation *find_span(CUdeviceptr address, size_t n)
{
	for (struct allocation *a = allocations; a; a = a->next)
		if (address >= a->address && address - a->address < a->size)
			return n <= a->size - (address - a->address) ? a : NULL;
	return NULL;
}

static void unlink_allocation(struct allocation *gone)
{
	for (struct allocation **p = &allocations; *p; p = &(*p)->next)
		if (*p == gone) {
			*p = gone->next;
			return;
		}
}

/* Maps `fd` twice: the PROT_NONE address callers see and the bytes copies use. */
static struct allocation *map_allocation(int fd, size_t size, uint64_t tag)
{
	struct allocation *a = calloc(1, sizeof(*a));
	if (!a)
		return NULL;
	void *reserved = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
			      -1, 0);
	void *bytes = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (reserved == MAP_FAILED || bytes == MAP_FAILED) {
		if (reserved != MAP_FAILED)
			munmap(reserved, size);
		if (bytes != MAP_FAILED)
			munmap(bytes, size);
		free(a);
		return NULL;
	}
	a->address = (CUdeviceptr)(uintptr_t)reserved;
	a->size = size;
	a->bytes = bytes;
	a->fd = fd;
	a->tag = tag;
	return a;
}

static void unmap_allocation(struct allocation *a)
{
	munmap((void *)(uintptr_t)a->address, a->size);
	munmap(a->bytes, a->size);
	close(a->fd);
	free(a);
}

/* -- initialisation, devices, contexts ------------------------------------------------------ */

CUresult cuInit(unsigned int flags)
{
	if (flags)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&lock);
	if (!initialized) {
		const char *env = getenv("CUDA_SIM_DEVICES");
		device_count = env ? atoi(env) : 1;
		if (device_count < 0)
			device_count = 0;
		primary = calloc(device_count ? device_count : 1, sizeof(*primary));
		for (int i = 0; i < device_count; i++)
			primary[i].device = i;
		initialized = 1;
	}
	pthread_mutex_unlock(&lock);
	return device_count ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
}

CUresult cuDriverGetVersion(int *version)
{
	if (!version)
		return CUDA_ERROR_INVALID_VALUE;
	*version = 13000;
	return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count)
{
	if (!initialized)
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!count)
		return CUDA_ERROR_INVALID_VALUE;
	*count = device_count;
	return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
	if (!initialized)
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!device)
		return CUDA_ERROR_INVALID_VALUE;
	if (ordinal < 0 || ordinal >= device_count)
		return CUDA_ERROR_INVALID_DEVICE;
	*device = ordinal;
	return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int length, CUdevice device)
{
	if (!initialized)
		return CUDA_ERROR_NOT_INITIALIZED;
	if (device < 0 || device >= device_count)
		return CUDA_ERROR_INVALID_DEVICE;
	if (!name || length <= 0)
		return CUDA_ERROR_INVALID_VALUE;
	snprintf(name, length, "bluecache CUDA simulator (no GPU)");
	return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *context, CUdevice device)
{
	if (!initialized)
		return CUDA_ERROR_NOT_INITIALIZED;
	if (device < 0 || device >= device_count)
		return CUDA_ERROR_INVALID_DEVICE;
	if (!context)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&lock);
	primary[device].retained++;
	pthread_mutex_unlock(&lock);
	*context = &primary[device];
	return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice device)
{
	if (!initialized)
		return CUDA_ERROR_NOT_INITIALIZED;
	if (device < 0 || device >= device_count)
		return CUDA_ERROR_INVALID_DEVICE;
	pthread_mutex_lock(&lock);
	CUresult r = primary[device].retained > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
	if (r == CUDA_SUCCESS)
		primary[device].retained--;
	pthread_mutex_unlock(&lock);
	return r;
}

CUresult cuCtxSetCurrent(CUcontext context)
{
	if (!initialized)
		return CUDA_ERROR_NOT_INITIALIZED;
	if (context && (context < primary || context >= primary + device_count))
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!context) {             /* NULL pops the top (a no-op on an empty stack) */
		current = depth ? below[--depth] : NULL;
		return CUDA_SUCCESS;
	}
	current = context;
	return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent(CUcontext context)
{
	if (!initialized)
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!context || context < primary || context >= primary + device_count)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (current) {
		if (depth == (int)(sizeof(below) / sizeof(below[0])))
			return CUDA_ERROR_OUT_OF_MEMORY;
		below[depth++] = current;
	}
	current = context;
	return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent(CUcontext *context)
{
	if (!initialized)
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!current)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (context)
		*context = current;
	current = depth ? below[--depth] : NULL;
	return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *context)
{
	if (!initialized)
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!context)
		return CUDA_ERROR_INVALID_VALUE;
	*context = current;
	return CUDA_SUCCESS;
}

static CUresult stream_run(CUstream stream);

CUresult cuCtxSynchronize(void)
{
	CUresult r = need_context();
	if (r)
		return r;
	pthread_mutex_lock(&lock);
	struct sim_stream *all = streams; /* a stream is destroyed only after its last use */
	pthread_mutex_unlock(&lock);
	CUresult first = CUDA_SUCCESS;
	for (struct sim_stream *st = all; st; st = st->next) {
		CUresult e = stream_run(st);
		if (!first)
			first = e;
	}
	return first;
}

/* -- device memory ------------------------------------------------------------------------- */

CUresult cuMemAlloc(CUdeviceptr *address, size_t size)
{
	CUresult r = need_context();
	if (r)
		return r;
	if (!address || !size)
		return CUDA_ERROR_INVALID_VALUE;
	uint64_t tag;
	if (getrandom(&tag, sizeof(tag), 0) != sizeof(tag))
		return CUDA_ERROR_OUT_OF_MEMORY;
	char name[48];
	snprintf(name, sizeof(name), "cuda-sim-%016llx", (unsigned long long)tag);
	int fd = memfd_create(name, MFD_CLOEXEC);
	if (fd < 0 || ftruncate(fd, size) < 0) {
		if (fd >= 0)
			close(fd);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	struct allocation *a = map_allocation(fd, size, tag);
	if (!a) {
		close(fd);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	a->context = current;
	pthread_mutex_lock(&lock);
	a->next = allocations;
	allocations = a;
	pthread_mutex_unlock(&lock);
	*address = a->address;
	return CUDA_SUCCESS;
}

CUresult cuMemFree(CUdeviceptr address)
{
	CUresult r = need_context();
	if (r)
		return r;
	pthread_mutex_lock(&lock);
	struct allocation *a = find_span(address, 1);
	if (!a || a->address != address || a->opened_ipc) {
		pthread_mutex_unlock(&lock);
		return CUDA_ERROR_INVALID_VALUE;
	}
	unlink_allocation(a);
	pthread_mutex_unlock(&lock);
	unmap_allocation(a);
	return CUDA_SUCCESS;
}

CUresult cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr address)
{
	CUresult r = need_context();
	if (r)
		return r;
	pthread_mutex_lock(&lock);
	struct allocation *a = find_span(address, 1);
	if (a) {
		if (base)
			*base = a->address;
		if (size)
			*size = a->size;
	}
	pthread_mutex_unlock(&lock);
	return a ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

enum { CU_POINTER_ATTRIBUTE_CONTEXT = 1, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9 };

CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr address)
{
	if (!initialized)
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!data)
		return CUDA_ERROR_INVALID_VALUE;
	if (attribute != CU_POINTER_ATTRIBUTE_CONTEXT &&
	    attribute != CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
		return CUDA_ERROR_NOT_SUPPORTED;    /* not simulated: no caller here asks */
	pthread_mutex_lock(&lock);
	struct allocation *a = find_span(address, 1);
	CUcontext context = a ? a->context : NULL;
	pthread_mutex_unlock(&lock);
	if (!a)
		return CUDA_ERROR_INVALID_VALUE;
	if (attribute == CU_POINTER_ATTRIBUTE_CONTEXT)
		*(CUcontext *)data = context;
	else
		*(int *)data = context->device;
	return CUDA_SUCCESS;
}

/* The allocation stays mapped while the lock is held, so the copy runs under it: copies of
 * different allocations serialise, which costs only speed in a simulator. */
static CUresult copy(CUdeviceptr device, void *host, size_t n, int to_host)
{
	CUresult r = need_context();
	if (r)
		return r;
	if (!host && n)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&lock);
	struct allocation *a = find_span(device, n ? n : 1);
	if (a) {
		char *bytes = a->bytes + (device - a->address);
		if (to_host)
			memcpy(host, bytes, n);
		else
			memcpy(bytes, host, n);
	}
	pthread_mutex_unlock(&lock);
	return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemcpyDtoH(void *host, CUdeviceptr device, size_t n)
{
	return copy(device, host, n, 1);
}

CUresult cuMemcpyHtoD(CUdeviceptr device, const void *host, size_t n)
{
	return copy(device, (void *)host, n, 0);
}

/* -- streams: queued copies, done when waited for --------------------------------------------- */

CUresult cuStreamCreate(CUstream *stream, unsigned int flags)
{
	(void)flags;
	CUresult r = need_context();
	if (r)
		return r;
	if (!stream)
		return CUDA_ERROR_INVALID_VALUE;
	struct sim_stream *st = calloc(1, sizeof(*st));
	if (!st)
		return CUDA_ERROR_OUT_OF_MEMORY;
	st->tail = &st->head;
	pthread_mutex_lock(&lock);
	st->next = streams;
	streams = st;
	pthread_mutex_unlock(&lock);
	*stream = st;
	return CUDA_SUCCESS;
}

/* The NULL stream or a default-stream handle: no queue, copies happen at once. */
static int default_stream(CUstream stream)
{
	return (uintptr_t)stream <= 2;
}

static int stream_known(CUstream stream)
{
	int known = 0;
	pthread_mutex_lock(&lock);
	for (struct sim_stream *st = streams; st && !known; st = st->next)
		known = st == stream;
	pthread_mutex_unlock(&lock);
	return known;
}

/* Does the stream's queued copies in order; the first error, and the rest are dropped. */
static CUresult stream_run(CUstream stream)
{
	pthread_mutex_lock(&lock);
	struct pending_copy *p = stream->head;
	stream->head = NULL;
	stream->tail = &stream->head;
	pthread_mutex_unlock(&lock);
	CUresult first = CUDA_SUCCESS;
	while (p) {
		struct pending_copy *next = p->next;
		if (!first)
			first = copy(p->device, p->host, p->n, p->to_host);
		free(p);
		p = next;
	}
	return first;
}

CUresult cuStreamSynchronize(CUstream stream)
{
	CUresult r = need_context();
	if (r)
		return r;
	if (default_stream(stream))
		return CUDA_SUCCESS;
	return stream_known(stream) ? stream_run(stream) : CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuStreamDestroy(CUstream stream)
{
	CUresult r = need_context();
	if (r)
		return r;
	if (default_stream(stream) || !stream_known(stream))
		return CUDA_ERROR_INVALID_HANDLE;
	stream_run(stream);   /* as the driver does: queued work completes first */
	pthread_mutex_lock(&lock);
	for (struct sim_stream **p = &streams; *p; p = &(*p)->next)
		if (*p == stream) {
			*p = stream->next;
			break;
		}
	pthread_mutex_unlock(&lock);
	free(stream);
	return CUDA_SUCCESS;
}

static CUresult enqueue(CUstream stream, CUdeviceptr device, void *host, size_t n, int to_host)
{
	CUresult r = need_context();
	if (r)
		return r;
	if (default_stream(stream))
		return copy(device, host, n, to_host);
	if (!stream_known(stream))
		return CUDA_ERROR_INVALID_HANDLE;
	if (!host && n)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&lock);
	int inside = find_span(device, n ? n : 1) != NULL;
	pthread_mutex_unlock(&lock);
	if (!inside)
		return CUDA_ERROR_INVALID_VALUE;
	struct pending_copy *p = calloc(1, sizeof(*p));
	if (!p)
		return CUDA_ERROR_OUT_OF_MEMORY;
	*p = (struct pending_copy){.device = device, .host = host, .n = n, .to_host = to_host};
	pthread_mutex_lock(&lock);
	*stream->tail = p;
	stream->tail = &p->next;
	pthread_mutex_unlock(&lock);
	return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoHAsync(void *host, CUdeviceptr device, size_t n, CUstream stream)
{
	return enqueue(stream, device, host, n, 1);
}

CUresult cuMemcpyHtoDAsync(CUdeviceptr device, const void *host, size_t n, CUstream stream)
{
	return enqueue(stream, device, (void *)host, n, 0);
}

CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr address, size_t size,
				       int kind, unsigned long long flags)
{
	(void)handle, (void)address, (void)size, (void)kind, (void)flags;
	CUresult r = need_context();
	return r ? r : CUDA_ERROR_NOT_SUPPORTED;
}

/* -- IPC ----------------------------------------------------------------------------------- */

CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr address)
{
	CUresult r = need_context();
	if (r)
		return r;
	if (!handle)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&lock);
	struct allocation *a = find_span(address, 1);
	struct handle_bytes h = {0};
	if (a && a->address == address && !a->opened_ipc) {
		h.magic = HANDLE_MAGIC;
		h.pid = getpid();
		h.fd = a->fd;
		h.tag = a->tag;
		h.size = a->size;
	}
	pthread_mutex_unlock(&lock);
	if (!h.magic)
		return CUDA_ERROR_INVALID_VALUE;
	memcpy(handle->reserved, &h, sizeof(h));
	return CUDA_SUCCESS;
}

/* The peer's memfd, if it is still the allocation the handle names. */
static int take_peer_fd(const struct handle_bytes *h)
{
	int pidfd = syscall(SYS_pidfd_open, h->pid, 0);
	if (pidfd < 0)
		return -1;
	int fd = syscall(SYS_pidfd_getfd, pidfd, h->fd, 0);
	close(pidfd);
	if (fd < 0)
		return -1;
	char path[64], target[128], expected[64];
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	ssize_t n = readlink(path, target, sizeof(target) - 1);
	target[n > 0 ? n : 0] = 0;
	snprintf(expected, sizeof(expected), "/memfd:cuda-sim-%016llx ", (unsigned long long)h->tag);
	if (strncmp(target, expected, strlen(expected)) != 0) {
		close(fd);
		return -1;
	}
	fcntl(fd, F_SETFD, FD_CLOEXEC);
	return fd;
}

CUresult cuIpcOpenMemHandle(CUdeviceptr *address, CUipcMemHandle handle, unsigned int flags)
{
	(void)flags;
	CUresult r = need_context();
	if (r)
		return r;
	struct handle_bytes h;
	memcpy(&h, handle.reserved, sizeof(h));
	if (!address || h.magic != HANDLE_MAGIC || !h.size)
		return CUDA_ERROR_INVALID_VALUE;
	if (h.pid == getpid())
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	for (struct allocation *a = allocations; a; a = a->next)
		if (a->opened_ipc && a->tag == h.tag && a->peer_pid == h.pid) {
			a->references++;
			*address = a->address;
			pthread_mutex_unlock(&lock);
			return CUDA_SUCCESS;
		}
	pthread_mutex_unlock(&lock);
	int fd = take_peer_fd(&h);
	if (fd < 0)
		return CUDA_ERROR_INVALID_VALUE;
	struct allocation *a = map_allocation(fd, h.size, h.tag);
	if (!a) {
		close(fd);
		return CUDA_ERROR_MAP_FAILED;
	}
	a->opened_ipc = 1;
	a->references = 1;
	a->context = current;
	a->peer_pid = h.pid;
	pthread_mutex_lock(&lock);
	struct allocation *raced = NULL;
	for (struct allocation *b = allocations; b; b = b->next)
		if (b->opened_ipc && b->tag == h.tag && b->peer_pid == h.pid)
			raced = b;
	if (raced) {   /* another thread opened the same handle meanwhile: share its mapping */
		raced->references++;
		*address = raced->address;
	} else {
		a->next = allocations;
		allocations = a;
		*address = a->address;
	}
	pthread_mutex_unlock(&lock);
	if (raced)
		unmap_allocation(a);
	return CUDA_SUCCESS;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr address)
{
	CUresult r = need_context();
	if (r)
		return r;
	pthread_mutex_lock(&lock);
	struct allocation *a = find_span(address, 1);
	if (!a || a->address != address || !a->opened_ipc) {
		pthread_mutex_unlock(&lock);
		return CUDA_ERROR_INVALID_VALUE;
	}
	int last = --a->references == 0;
	if (last)
		unlink_allocation(a);
	pthread_mutex_unlock(&lock);
	if (last)
		unmap_allocation(a);
	return CUDA_SUCCESS;
}

/* -- page-locked host memory --------------------------------------------------------------- */

static CUresult add_host_range(char *start, size_t size, int pinned_alloc)
{
	struct host_range *h = calloc(1, sizeof(*h));
	if (!h)
		return CUDA_ERROR_OUT_OF_MEMORY;
	h->start = start;
	h->size = size;
	h->pinned_alloc = pinned_alloc;
	pthread_mutex_lock(&lock);
	for (struct host_range *o = host_ranges; o; o = o->next)
		if (start < o->start + o->size && o->start < start + size) {
			pthread_mutex_unlock(&lock);
			free(h);
			return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
		}
	h->next = host_ranges;
	host_ranges = h;
	pthread_mutex_unlock(&lock);
	return CUDA_SUCCESS;
}

/* Unlinks the range starting at `start` made by register (0) or alloc (1); its size, or 0. */
static size_t remove_host_range(char *start, int pinned_alloc)
{
	size_t size = 0;
	pthread_mutex_lock(&lock);
	for (struct host_range **p = &host_ranges; *p; p = &(*p)->next)
		if ((*p)->start == start && (*p)->pinned_alloc == pinned_alloc) {
			struct host_range *gone = *p;
			*p = gone->next;
			size = gone->size;
			free(gone);
			break;
		}
	pthread_mutex_unlock(&lock);
	return size;
}

CUresult cuMemHostRegister(void *start, size_t size, unsigned int flags)
{
	(void)flags;
	CUresult r = need_context();
	if (r)
		return r;
	if (!start || !size)
		return CUDA_ERROR_INVALID_VALUE;
	return add_host_range(start, size, 0);
}

CUresult cuMemHostUnregister(void *start)
{
	CUresult r = need_context();
	if (r)
		return r;
	return remove_host_range(start, 0) ? CUDA_SUCCESS : CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
}

CUresult cuMemAllocHost(void **start, size_t size)
{
	CUresult r = need_context();
	if (r)
		return r;
	if (!start || !size)
		return CUDA_ERROR_INVALID_VALUE;
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
		       -1, 0);
	if (p == MAP_FAILED)
		return CUDA_ERROR_OUT_OF_MEMORY;
	r = add_host_range(p, size, 1);
	if (r)
		munmap(p, size);
	else
		*start = p;
	return r;
}

CUresult cuMemFreeHost(void *start)
{
	CUresult r = need_context();
	if (r)
		return r;
	size_t size = remove_host_range(start, 1);
	if (!size)
		return CUDA_ERROR_INVALID_VALUE;
	munmap(start, size);
	return CUDA_SUCCESS;
}

/* -- errors and entry points --------------------------------------------------------------- */

CUresult cuGetErrorName(CUresult code, const char **name)
{
	for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); i++)
		if (errors[i].code == code) {
			*name = errors[i].name;
			return CUDA_SUCCESS;
		}
	*name = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult code, const char **text)
{
	for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); i++)
		if (errors[i].code == code) {
			*text = errors[i].text;
			return CUDA_SUCCESS;
		}
	*text = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

/* The CUDA version from which each call has the ABI implemented here (the _v2 calls changed
 * CUdeviceptr to 64 bits in 3.2; cuIpcOpenMemHandle's current entry is from 11.0). */
#define ENTRY(fn, since) {#fn, (void *)fn, since}
static const struct { const char *name; void *fn; int since; } entries[] = {
	ENTRY(cuInit, 2000), ENTRY(cuDriverGetVersion, 2020), ENTRY(cuDeviceGetCount, 2000),
	ENTRY(cuDeviceGet, 2000), ENTRY(cuDeviceGetName, 2000),
	ENTRY(cuDevicePrimaryCtxRetain, 7000), ENTRY(cuDevicePrimaryCtxRelease, 11000),
	ENTRY(cuCtxSetCurrent, 4000), ENTRY(cuCtxGetCurrent, 4000), ENTRY(cuCtxSynchronize, 2000),
	ENTRY(cuCtxPushCurrent, 4000), ENTRY(cuCtxPopCurrent, 4000),
	ENTRY(cuPointerGetAttribute, 4000),
	ENTRY(cuMemAlloc, 3020), ENTRY(cuMemFree, 3020), ENTRY(cuMemGetAddressRange, 3020),
	ENTRY(cuMemcpyDtoH, 3020), ENTRY(cuMemcpyHtoD, 3020),
	ENTRY(cuMemcpyDtoHAsync, 3020), ENTRY(cuMemcpyHtoDAsync, 3020),
	ENTRY(cuStreamCreate, 2000), ENTRY(cuStreamDestroy, 4000),
	ENTRY(cuStreamSynchronize, 2000),
	ENTRY(cuMemGetHandleForAddressRange, 11070),
	ENTRY(cuIpcGetMemHandle, 4010), ENTRY(cuIpcOpenMemHandle, 11000),
	ENTRY(cuIpcCloseMemHandle, 4010),
	ENTRY(cuMemHostRegister, 6050), ENTRY(cuMemHostUnregister, 4000),
	ENTRY(cuMemAllocHost, 3020), ENTRY(cuMemFreeHost, 2000),
	ENTRY(cuGetErrorName, 6000), ENTRY(cuGetErrorString, 6000),
};

enum { SYMBOL_FOUND = 0, SYMBOL_NOT_FOUND = 1, VERSION_NOT_SUFFICIENT = 2 };

CUresult cuGetProcAddress_v2(const char *symbol, void **fn, int version,
			     unsigned long long flags, int *status)
{
	(void)flags;
	if (!symbol || !fn)
		return CUDA_ERROR_INVALID_VALUE;
	*fn = NULL;
	for (size_t i = 0; i < sizeof(entries) / sizeof(entries[0]); i++)
		if (strcmp(entries[i].name, symbol) == 0) {
			if (version < entries[i].since) {
				if (status)
					*status = VERSION_NOT_SUFFICIENT;
				return CUDA_ERROR_NOT_FOUND;
			}
			*fn = entries[i].fn;
			if (status)
				*status = SYMBOL_FOUND;
			return CUDA_SUCCESS;
		}
	if (status)
		*status = SYMBOL_NOT_FOUND;
	return CUDA_ERROR_NOT_FOUND;
}
