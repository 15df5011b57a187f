/*
 * DOCA API simulator: the DOCA functions bluecache calls (doca_sim.h), implemented on plain
 * Linux so that the DOCA DMA engine and hostd's export path run end to end without a BlueField.
 * NOTHING here touches a DPU or PCIe: it is a stand-in whose behaviour follows the documented
 * DOCA semantics that matter to a caller:
 *
 *  - contexts: IDLE -> RUNNING on doca_ctx_start (needs a progress engine and a task config);
 *    doca_ctx_stop with tasks in flight answers DOCA_ERROR_IN_PROGRESS and moves to STOPPING;
 *    doca_pe_progress finishes them and moves to IDLE (state-changed callback inside progress).
 *  - tasks: a pool of num_memcpy_tasks (alloc answers DOCA_ERROR_NO_MEMORY when it is empty);
 *    doca_task_submit answers DOCA_ERROR_TOO_BIG above the device's max_buf_size; completion
 *    and error callbacks run only inside doca_pe_progress, on the thread calling it.
 *  - buffers: an inventory of a fixed number of doca_bufs (DOCA_ERROR_NO_MEMORY when empty);
 *    a buffer must lie inside its started mmap (DOCA_ERROR_INVALID_VALUE otherwise).
 *  - export: doca_mmap_export_pci gives a descriptor naming the exporting process (pid and its
 *    start time) and the memory's address there; doca_mmap_create_from_export in another process
 *    checks that process is still the same one, and the "DMA engine" (one worker thread per
 *    context, so copies overlap with submission as on hardware) moves bytes with
 *    process_vm_readv/process_vm_writev. That needs ptrace access to the exporter: root, or
 *    CAP_SYS_PTRACE, or the same user with Yama's ptrace_scope at 0 (docs/hardware.md).
 *
 * Tunables (environment, read once): DOCA_SIM_MAX_BUF_SIZE (bytes, default 2 MiB),
 * DOCA_SIM_MAX_TASKS (default 1024).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "doca_sim.h"

#define SIM_MAGIC "DOCASIM1"
#define SIM_DEVICES 2
#define SIM_MAX_MMAP_DEVS 4
#define SIM_COMPLETIONS_PER_PROGRESS 16

/* -- errors ------------------------------------------------------------------------------- */

static const char *const error_names[] = {
	"DOCA_SUCCESS", "DOCA_ERROR_UNKNOWN", "DOCA_ERROR_NOT_PERMITTED", "DOCA_ERROR_IN_USE",
	"DOCA_ERROR_NOT_SUPPORTED", "DOCA_ERROR_AGAIN", "DOCA_ERROR_INVALID_VALUE",
	"DOCA_ERROR_NO_MEMORY", "DOCA_ERROR_INITIALIZATION", "DOCA_ERROR_TIME_OUT",
	"DOCA_ERROR_SHUTDOWN", "DOCA_ERROR_CONNECTION_RESET", "DOCA_ERROR_CONNECTION_ABORTED",
	"DOCA_ERROR_CONNECTION_INPROGRESS", "DOCA_ERROR_NOT_CONNECTED", "DOCA_ERROR_NO_LOCK",
	"DOCA_ERROR_NOT_FOUND", "DOCA_ERROR_IO_FAILED", "DOCA_ERROR_BAD_STATE",
	"DOCA_ERROR_UNSUPPORTED_VERSION", "DOCA_ERROR_OPERATING_SYSTEM", "DOCA_ERROR_DRIVER",
	"DOCA_ERROR_UNEXPECTED", "DOCA_ERROR_ALREADY_EXIST", "DOCA_ERROR_FULL", "DOCA_ERROR_EMPTY",
	"DOCA_ERROR_IN_PROGRESS", "DOCA_ERROR_TOO_BIG", "DOCA_ERROR_AUTHENTICATION",
	"DOCA_ERROR_BAD_CONFIG", "DOCA_ERROR_SKIPPED",
};

static const char *const error_descrs[] = {
	"Success", "Unknown error", "Operation not permitted", "Resource already in use",
	"Operation not supported", "Resource temporarily unavailable, try again", "Invalid input",
	"Memory allocation failure", "Resource initialization failure",
	"Timer expired waiting for resource", "Shut down in process or completed",
	"Connection reset by peer", "Connection aborted", "Connection in progress",
	"Not Connected", "Unable to acquire required lock", "Resource Not Found",
	"Input/Output Operation Failed", "Bad State", "Unsupported version",
	"Operating system call failure", "DOCA Driver call failure",
	"An unexpected scenario was detected", "Resource already exist", "No more space in resource",
	"No entry is available in resource", "Operation is in progress",
	"Requested operation too big to be contained", "Authentication failure",
	"Configuration is not valid", "Result is valid, but some previous output data was dropped",
};

const char *doca_error_get_name(doca_error_t error)
{
	if ((unsigned)error < sizeof(error_names) / sizeof(error_names[0]))
		return error_names[error];
	return "DOCA_ERROR_UNKNOWN";
}

const char *doca_error_get_descr(doca_error_t error)
{
	if ((unsigned)error < sizeof(error_descrs) / sizeof(error_descrs[0]))
		return error_descrs[error];
	return "Unknown error";
}

/* The DOCA release whose documented behaviour this simulates. */
const char *doca_version_runtime(void)
{
	return "2.10.0087-simulator";
}

/* -- tunables ----------------------------------------------------------------------------- */

static uint64_t env_u64(const char *name, uint64_t fallback)
{
	const char *text = getenv(name);
	char *end;
	unsigned long long value;

	if (text == NULL || *text == '\0')
		return fallback;
	value = strtoull(text, &end, 10);
	return (*end == '\0' && value > 0) ? value : fallback;
}

static uint64_t sim_max_buf_size(void) { return env_u64("DOCA_SIM_MAX_BUF_SIZE", 2u << 20); }
static uint32_t sim_max_tasks(void) { return (uint32_t)env_u64("DOCA_SIM_MAX_TASKS", 1024); }

/* -- devices ------------------------------------------------------------------------------ */

struct doca_devinfo {
	char pci[DOCA_DEVINFO_PCI_ADDR_SIZE];
};

struct doca_dev {
	struct doca_devinfo *info;
};

/* A DPU-side function (03:00.0, as on a BlueField-3 in DPU mode) and a host-side PF (b1:00.0). */
static struct doca_devinfo sim_devices[SIM_DEVICES] = {{"0000:03:00.0"}, {"0000:b1:00.0"}};

doca_error_t doca_devinfo_create_list(struct doca_devinfo ***dev_list, uint32_t *nb_devs)
{
	struct doca_devinfo **list;
	int i;

	if (dev_list == NULL || nb_devs == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	list = calloc(SIM_DEVICES + 1, sizeof(*list));
	if (list == NULL)
		return DOCA_ERROR_NO_MEMORY;
	for (i = 0; i < SIM_DEVICES; i++)
		list[i] = &sim_devices[i];
	*dev_list = list;
	*nb_devs = SIM_DEVICES;
	return DOCA_SUCCESS;
}

doca_error_t doca_devinfo_destroy_list(struct doca_devinfo **dev_list)
{
	if (dev_list == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	free(dev_list);
	return DOCA_SUCCESS;
}

doca_error_t doca_devinfo_get_pci_addr_str(const struct doca_devinfo *devinfo, char *pci_addr_str)
{
	if (devinfo == NULL || pci_addr_str == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	memcpy(pci_addr_str, devinfo->pci, DOCA_DEVINFO_PCI_ADDR_SIZE);
	return DOCA_SUCCESS;
}

/* "BB:DD.F" or "DDDD:BB:DD.F", hex digits, as DOCA accepts them. */
static int normalize_pci(const char *text, char out[DOCA_DEVINFO_PCI_ADDR_SIZE])
{
	unsigned domain = 0, bus, dev, fn;
	char tail;
	size_t len = strlen(text);

	if (len == 7 && sscanf(text, "%2x:%2x.%1x%c", &bus, &dev, &fn, &tail) == 3)
		;
	else if (len == 12 && sscanf(text, "%4x:%2x:%2x.%1x%c", &domain, &bus, &dev, &fn, &tail) == 4)
		;
	else
		return -1;
	if (dev > 0x1f || fn > 7)
		return -1;
	snprintf(out, DOCA_DEVINFO_PCI_ADDR_SIZE, "%04x:%02x:%02x.%x", domain, bus, dev, fn);
	return 0;
}

doca_error_t doca_devinfo_is_equal_pci_addr(const struct doca_devinfo *devinfo,
					    const char *pci_addr_str, uint8_t *is_equal)
{
	char want[DOCA_DEVINFO_PCI_ADDR_SIZE];

	if (devinfo == NULL || pci_addr_str == NULL || is_equal == NULL ||
	    normalize_pci(pci_addr_str, want) != 0)
		return DOCA_ERROR_INVALID_VALUE;
	*is_equal = strcmp(want, devinfo->pci) == 0;
	return DOCA_SUCCESS;
}

doca_error_t doca_dev_open(struct doca_devinfo *devinfo, struct doca_dev **dev)
{
	struct doca_dev *d;

	if (devinfo == NULL || dev == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	d = calloc(1, sizeof(*d));
	if (d == NULL)
		return DOCA_ERROR_NO_MEMORY;
	d->info = devinfo;
	*dev = d;
	return DOCA_SUCCESS;
}

doca_error_t doca_dev_close(struct doca_dev *dev)
{
	if (dev == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	free(dev);
	return DOCA_SUCCESS;
}

struct doca_devinfo *doca_dev_as_devinfo(const struct doca_dev *dev)
{
	return dev ? dev->info : NULL;
}

/* -- memory maps -------------------------------------------------------------------------- */

struct sim_export {
	char magic[8];
	uint32_t struct_size;
	uint32_t permissions;
	int64_t pid;
	uint64_t start_time;   /* the exporter's start time (/proc/PID/stat): a reused pid fails */
	uint64_t user_base;    /* the address the exporter gave (what buffers are addressed by) */
	uint64_t real_base;    /* where those bytes are in the exporter's address space */
	uint64_t length;
};

struct doca_mmap {
	int started;
	int has_range;
	int from_export;
	int exported;
	uint32_t permissions;
	struct doca_dev *devs[SIM_MAX_MMAP_DEVS];
	int ndevs;
	char *user_base;
	char *real_base;        /* local for a local mmap; the exporter's for an imported one */
	size_t length;
	void *dmabuf_map;       /* set_dmabuf_memrange: our own mapping of the dma-buf */
	size_t dmabuf_map_len;
	pid_t pid;              /* imported: the exporter */
	int pidfd;
	uint32_t bufs;          /* doca_bufs pointing into this mmap */
	struct sim_export desc;
};

doca_error_t doca_mmap_create(struct doca_mmap **mmap)
{
	struct doca_mmap *m;

	if (mmap == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	m = calloc(1, sizeof(*m));
	if (m == NULL)
		return DOCA_ERROR_NO_MEMORY;
	m->pidfd = -1;
	*mmap = m;
	return DOCA_SUCCESS;
}

doca_error_t doca_mmap_destroy(struct doca_mmap *mmap)
{
	if (mmap == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	if (mmap->bufs)
		return DOCA_ERROR_NOT_PERMITTED;
	if (mmap->dmabuf_map)
		munmap(mmap->dmabuf_map, mmap->dmabuf_map_len);
	if (mmap->pidfd >= 0)
		close(mmap->pidfd);
	free(mmap);
	return DOCA_SUCCESS;
}

doca_error_t doca_mmap_add_dev(struct doca_mmap *mmap, struct doca_dev *dev)
{
	if (mmap == NULL || dev == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	if (mmap->started || mmap->from_export)
		return DOCA_ERROR_NOT_PERMITTED;
	if (mmap->ndevs == SIM_MAX_MMAP_DEVS)
		return DOCA_ERROR_NO_MEMORY;
	mmap->devs[mmap->ndevs++] = dev;
	return DOCA_SUCCESS;
}

doca_error_t doca_mmap_set_permissions(struct doca_mmap *mmap, uint32_t access_mask)
{
	if (mmap == NULL || access_mask & ~0x7fu)
		return DOCA_ERROR_INVALID_VALUE;
	if (mmap->started)
		return DOCA_ERROR_BAD_STATE;
	mmap->permissions = access_mask;
	return DOCA_SUCCESS;
}

doca_error_t doca_mmap_set_memrange(struct doca_mmap *mmap, void *addr, size_t len)
{
	if (mmap == NULL || addr == NULL || len == 0 || (uintptr_t)addr + len < (uintptr_t)addr)
		return DOCA_ERROR_INVALID_VALUE;
	if (mmap->started)
		return DOCA_ERROR_BAD_STATE;
	if (mmap->has_range)
		return DOCA_ERROR_NOT_PERMITTED;
	mmap->user_base = mmap->real_base = addr;
	mmap->length = len;
	mmap->has_range = 1;
	return DOCA_SUCCESS;
}

static void *sys_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t offset)
{
	return mmap(addr, len, prot, flags, fd, offset);
}

/* The simulator reaches a dma-buf by mapping it: that works for host-memory dma-bufs (udmabuf)
 * and fails for GPU ones, which only a real NIC can reach (answered DOCA_ERROR_NOT_SUPPORTED). */
doca_error_t doca_mmap_set_dmabuf_memrange(struct doca_mmap *mmap, int dmabuf_fd, void *addr,
					   size_t dmabuf_offset, size_t len)
{
	long page = sysconf(_SC_PAGESIZE);
	size_t skew;
	void *map;

	if (mmap == NULL || dmabuf_fd < 0 || len == 0 || (uintptr_t)addr + len < (uintptr_t)addr)
		return DOCA_ERROR_INVALID_VALUE;
	if (mmap->started)
		return DOCA_ERROR_BAD_STATE;
	if (mmap->has_range)
		return DOCA_ERROR_NOT_PERMITTED;
	skew = dmabuf_offset % (size_t)page;
	map = sys_mmap(NULL, len + skew, PROT_READ | PROT_WRITE, MAP_SHARED, dmabuf_fd,
		   (off_t)(dmabuf_offset - skew));
	if (map == MAP_FAILED)
		return DOCA_ERROR_NOT_SUPPORTED;
	mmap->dmabuf_map = map;
	mmap->dmabuf_map_len = len + skew;
	mmap->user_base = addr;
	mmap->real_base = (char *)map + skew;
	mmap->length = len;
	mmap->has_range = 1;
	return DOCA_SUCCESS;
}

doca_error_t doca_mmap_get_memrange(const struct doca_mmap *mmap, void **addr, size_t *len)
{
	if (mmap == NULL || addr == NULL || len == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	if (!mmap->has_range)
		return DOCA_ERROR_BAD_STATE;
	*addr = mmap->user_base;
	*len = mmap->length;
	return DOCA_SUCCESS;
}

doca_error_t doca_mmap_start(struct doca_mmap *mmap)
{
	if (mmap == NULL || !mmap->has_range || mmap->ndevs == 0)
		return DOCA_ERROR_INVALID_VALUE;
	if (mmap->from_export)
		return DOCA_ERROR_NOT_PERMITTED;
	mmap->started = 1;
	return DOCA_SUCCESS;
}

doca_error_t doca_mmap_stop(struct doca_mmap *mmap)
{
	if (mmap == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	if (mmap->exported || mmap->from_export)
		return DOCA_ERROR_NOT_PERMITTED;
	if (mmap->bufs)
		return DOCA_ERROR_NOT_PERMITTED;
	mmap->started = 0;
	return DOCA_SUCCESS;
}

static uint64_t process_start_time(pid_t pid)
{
	char path[64], buf[1024];
	unsigned long long start = 0;
	FILE *f;
	char *p;
	int field;

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	f = fopen(path, "r");
	if (f == NULL)
		return 0;
	if (fgets(buf, sizeof(buf), f) == NULL) {
		fclose(f);
		return 0;
	}
	fclose(f);
	p = strrchr(buf, ')');   /* the command name may hold spaces and parentheses */
	if (p == NULL)
		return 0;
	for (field = 2; field < 22 && p; field++)
		p = strchr(p + 1, ' ');
	if (p)
		sscanf(p + 1, "%llu", &start);
	return start;
}

doca_error_t doca_mmap_export_pci(struct doca_mmap *mmap, const struct doca_dev *dev,
				  const void **export_desc, size_t *export_desc_len)
{
	int i, found = 0;

	if (mmap == NULL || dev == NULL || export_desc == NULL || export_desc_len == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	for (i = 0; i < mmap->ndevs; i++)
		found |= mmap->devs[i] == dev;
	if (!found)
		return DOCA_ERROR_NOT_FOUND;
	if (!mmap->started || mmap->from_export ||
	    !(mmap->permissions & (DOCA_ACCESS_FLAG_PCI_READ_ONLY | DOCA_ACCESS_FLAG_PCI_READ_WRITE)))
		return DOCA_ERROR_NOT_PERMITTED;
	memset(&mmap->desc, 0, sizeof(mmap->desc));
	memcpy(mmap->desc.magic, SIM_MAGIC, sizeof(mmap->desc.magic));
	mmap->desc.struct_size = sizeof(mmap->desc);
	mmap->desc.permissions = mmap->permissions;
	mmap->desc.pid = getpid();
	mmap->desc.start_time = process_start_time(getpid());
	mmap->desc.user_base = (uintptr_t)mmap->user_base;
	mmap->desc.real_base = (uintptr_t)mmap->real_base;
	mmap->desc.length = mmap->length;
	mmap->exported = 1;
	*export_desc = &mmap->desc;
	*export_desc_len = sizeof(mmap->desc);
	return DOCA_SUCCESS;
}

doca_error_t doca_mmap_create_from_export(const union doca_data *user_data,
					  const void *export_desc, size_t export_desc_len,
					  struct doca_dev *dev, struct doca_mmap **mmap)
{
	struct sim_export desc;
	struct doca_mmap *m;
	int pidfd;

	(void)user_data;
	if (export_desc == NULL || dev == NULL || mmap == NULL ||
	    export_desc_len != sizeof(desc))
		return DOCA_ERROR_INVALID_VALUE;
	memcpy(&desc, export_desc, sizeof(desc));
	if (memcmp(desc.magic, SIM_MAGIC, sizeof(desc.magic)) != 0 ||
	    desc.struct_size != sizeof(desc) || desc.length == 0 || desc.pid <= 0)
		return DOCA_ERROR_INVALID_VALUE;
	pidfd = (int)syscall(SYS_pidfd_open, (pid_t)desc.pid, 0);
	if (pidfd < 0)
		return DOCA_ERROR_NOT_FOUND;
	if (process_start_time((pid_t)desc.pid) != desc.start_time) {
		close(pidfd);
		return DOCA_ERROR_NOT_FOUND;   /* the exporter is gone and its pid reused */
	}
	m = calloc(1, sizeof(*m));
	if (m == NULL) {
		close(pidfd);
		return DOCA_ERROR_NO_MEMORY;
	}
	m->started = m->has_range = m->from_export = 1;
	m->permissions = desc.permissions;
	m->devs[0] = dev;
	m->ndevs = 1;
	m->user_base = (char *)(uintptr_t)desc.user_base;
	m->real_base = (char *)(uintptr_t)desc.real_base;
	m->length = desc.length;
	m->pid = (pid_t)desc.pid;
	m->pidfd = pidfd;
	m->desc = desc;
	*mmap = m;
	return DOCA_SUCCESS;
}

/* -- buffers ------------------------------------------------------------------------------ */

struct doca_buf {
	struct doca_buf_inventory *inventory;
	struct doca_mmap *mmap;
	char *addr;
	size_t len;
	char *data;
	size_t data_len;
	uint16_t refcount;
	struct doca_buf *next_free;
};

struct doca_buf_inventory {
	int started;
	size_t count;
	size_t free_count;
	struct doca_buf *elements;
	struct doca_buf *free_list;
};

doca_error_t doca_buf_inventory_create(size_t num_elements, struct doca_buf_inventory **inventory)
{
	struct doca_buf_inventory *inv;
	size_t i;

	if (inventory == NULL || num_elements == 0)
		return DOCA_ERROR_INVALID_VALUE;
	inv = calloc(1, sizeof(*inv));
	if (inv == NULL)
		return DOCA_ERROR_NO_MEMORY;
	inv->elements = calloc(num_elements, sizeof(*inv->elements));
	if (inv->elements == NULL) {
		free(inv);
		return DOCA_ERROR_NO_MEMORY;
	}
	inv->count = inv->free_count = num_elements;
	for (i = 0; i < num_elements; i++) {
		inv->elements[i].inventory = inv;
		inv->elements[i].next_free = i + 1 < num_elements ? &inv->elements[i + 1] : NULL;
	}
	inv->free_list = inv->elements;
	*inventory = inv;
	return DOCA_SUCCESS;
}

doca_error_t doca_buf_inventory_destroy(struct doca_buf_inventory *inventory)
{
	if (inventory == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	if (inventory->free_count != inventory->count)
		return DOCA_ERROR_IN_USE;
	free(inventory->elements);
	free(inventory);
	return DOCA_SUCCESS;
}

doca_error_t doca_buf_inventory_start(struct doca_buf_inventory *inventory)
{
	if (inventory == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	inventory->started = 1;
	return DOCA_SUCCESS;
}

doca_error_t doca_buf_inventory_stop(struct doca_buf_inventory *inventory)
{
	if (inventory == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	if (inventory->free_count != inventory->count)
		return DOCA_ERROR_IN_USE;
	inventory->started = 0;
	return DOCA_SUCCESS;
}

doca_error_t doca_buf_inventory_get_num_free_elements(const struct doca_buf_inventory *inventory,
						      uint32_t *num_of_free_elements)
{
	if (inventory == NULL || num_of_free_elements == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	*num_of_free_elements = (uint32_t)inventory->free_count;
	return DOCA_SUCCESS;
}

static int inside(const char *outer, size_t outer_len, const char *p, size_t len)
{
	return p >= outer && len <= outer_len && (size_t)(p - outer) <= outer_len - len;
}

doca_error_t doca_buf_inventory_buf_get_by_args(struct doca_buf_inventory *inventory,
						struct doca_mmap *mmap, void *addr, size_t len,
						void *data, size_t data_len, struct doca_buf **buf)
{
	struct doca_buf *b;

	if (inventory == NULL || mmap == NULL || buf == NULL || !inventory->started ||
	    !mmap->started || !inside(mmap->user_base, mmap->length, addr, len) ||
	    !inside(addr, len, data, data_len))
		return DOCA_ERROR_INVALID_VALUE;
	if (inventory->free_list == NULL)
		return DOCA_ERROR_NO_MEMORY;
	b = inventory->free_list;
	inventory->free_list = b->next_free;
	inventory->free_count--;
	b->mmap = mmap;
	b->addr = addr;
	b->len = len;
	b->data = data;
	b->data_len = data_len;
	b->refcount = 1;
	mmap->bufs++;
	*buf = b;
	return DOCA_SUCCESS;
}

doca_error_t doca_buf_dec_refcount(struct doca_buf *buf, uint16_t *refcount)
{
	struct doca_buf_inventory *inv;

	if (buf == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	if (buf->refcount == 0)
		return DOCA_ERROR_BAD_STATE;
	if (--buf->refcount == 0) {
		inv = buf->inventory;
		buf->mmap->bufs--;
		buf->mmap = NULL;
		buf->next_free = inv->free_list;
		inv->free_list = buf;
		inv->free_count++;
	}
	if (refcount)
		*refcount = buf->refcount;
	return DOCA_SUCCESS;
}

doca_error_t doca_buf_get_data(const struct doca_buf *buf, void **data)
{
	if (buf == NULL || data == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	*data = buf->data;
	return DOCA_SUCCESS;
}

doca_error_t doca_buf_get_data_len(const struct doca_buf *buf, size_t *data_len)
{
	if (buf == NULL || data_len == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	*data_len = buf->data_len;
	return DOCA_SUCCESS;
}

doca_error_t doca_buf_set_data(struct doca_buf *buf, void *data, size_t data_len)
{
	if (buf == NULL || !inside(buf->addr, buf->len, data, data_len))
		return DOCA_ERROR_INVALID_VALUE;
	buf->data = data;
	buf->data_len = data_len;
	return DOCA_SUCCESS;
}

/* -- progress engine, context, DMA -------------------------------------------------------- */

struct doca_task {
	struct doca_dma *dma;
	doca_error_t status;
	union doca_data user_data;
	int allocated;
	int submitted;
	struct doca_task *next;
};

/* A memcpy task is a task with its buffers; DOCA's as_task is the same pointer. */
struct doca_dma_task_memcpy {
	struct doca_task base;
	struct doca_buf *src;
	struct doca_buf *dst;
};

struct doca_ctx {
	struct doca_dma *dma;
};

struct doca_pe {
	struct doca_dma *dma;   /* one connected context is all bluecache needs */
};

struct doca_dma {
	struct doca_ctx ctx;          /* first: doca_dma_as_ctx is a cast */
	struct doca_dev *dev;
	struct doca_pe *pe;
	enum doca_ctx_states state;
	int state_change_pending;
	enum doca_ctx_states prev_state;
	doca_ctx_state_changed_callback_t state_cb;
	union doca_data ctx_user_data;
	doca_dma_task_memcpy_completion_cb_t done_cb, err_cb;
	uint32_t num_tasks;
	struct doca_dma_task_memcpy *tasks;
	struct doca_task *free_tasks;
	size_t inflight;              /* submitted, callback not yet run */
	/* the simulated engine: submitted -> worker copies -> completed -> progress reaps */
	pthread_t worker;
	int worker_running;
	int worker_exit;
	pthread_mutex_t lock;
	pthread_cond_t wake;
	struct doca_task *queue_head, *queue_tail;
	struct doca_task *done_head, *done_tail;
};

doca_error_t doca_pe_create(struct doca_pe **pe)
{
	struct doca_pe *p;

	if (pe == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	p = calloc(1, sizeof(*p));
	if (p == NULL)
		return DOCA_ERROR_NO_MEMORY;
	*pe = p;
	return DOCA_SUCCESS;
}

doca_error_t doca_pe_destroy(struct doca_pe *pe)
{
	if (pe == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	if (pe->dma != NULL)
		return DOCA_ERROR_IN_USE;
	free(pe);
	return DOCA_SUCCESS;
}

doca_error_t doca_pe_connect_ctx(struct doca_pe *pe, struct doca_ctx *ctx)
{
	if (pe == NULL || ctx == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	if (ctx->dma->pe != NULL)
		return DOCA_ERROR_NOT_PERMITTED;
	if (ctx->dma->state != DOCA_CTX_STATE_IDLE)
		return DOCA_ERROR_BAD_STATE;
	if (pe->dma != NULL)
		return DOCA_ERROR_NO_MEMORY;   /* the simulator's PE holds one context */
	pe->dma = ctx->dma;
	ctx->dma->pe = pe;
	return DOCA_SUCCESS;
}

doca_error_t doca_pe_get_num_inflight_tasks(const struct doca_pe *pe, size_t *num_inflight_tasks)
{
	if (pe == NULL || num_inflight_tasks == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	*num_inflight_tasks = pe->dma ? pe->dma->inflight : 0;
	return DOCA_SUCCESS;
}

/* Local bytes of a buffer's data, or the exporter's address for an imported mmap. */
static char *real_address(const struct doca_buf *buf, const char *user_address)
{
	return buf->mmap->real_base + (user_address - buf->mmap->user_base);
}

static int exporter_alive(const struct doca_mmap *m)
{
	struct pollfd p = {.fd = m->pidfd, .events = POLLIN};

	return poll(&p, 1, 0) == 0;   /* a pidfd turns readable when the process exits */
}

static doca_error_t copy_now(struct doca_dma_task_memcpy *t)
{
	struct doca_buf *src = t->src, *dst = t->dst;
	size_t n = src->data_len;
	char *to = real_address(dst, dst->data + dst->data_len);
	char *from = real_address(src, src->data);
	struct iovec local, remote;
	ssize_t done;

	if (!src->mmap->from_export && !dst->mmap->from_export) {
		memcpy(to, from, n);
	} else {
		struct doca_mmap *far = src->mmap->from_export ? src->mmap : dst->mmap;

		if (!exporter_alive(far))
			return DOCA_ERROR_IO_FAILED;
		local.iov_len = remote.iov_len = n;
		if (src->mmap->from_export) {
			local.iov_base = to;
			remote.iov_base = from;
			done = process_vm_readv(far->pid, &local, 1, &remote, 1, 0);
		} else {
			local.iov_base = from;
			remote.iov_base = to;
			done = process_vm_writev(far->pid, &local, 1, &remote, 1, 0);
		}
		if (done != (ssize_t)n)
			return DOCA_ERROR_IO_FAILED;
	}
	dst->data_len += n;
	return DOCA_SUCCESS;
}

static void *engine_worker(void *arg)
{
	struct doca_dma *dma = arg;
	struct doca_task *task;

	pthread_mutex_lock(&dma->lock);
	for (;;) {
		while (dma->queue_head == NULL && !dma->worker_exit)
			pthread_cond_wait(&dma->wake, &dma->lock);
		if (dma->queue_head == NULL)
			break;
		task = dma->queue_head;
		dma->queue_head = task->next;
		if (dma->queue_head == NULL)
			dma->queue_tail = NULL;
		pthread_mutex_unlock(&dma->lock);
		task->status = copy_now((struct doca_dma_task_memcpy *)task);
		pthread_mutex_lock(&dma->lock);
		task->next = NULL;
		if (dma->done_tail)
			dma->done_tail->next = task;
		else
			dma->done_head = task;
		dma->done_tail = task;
	}
	pthread_mutex_unlock(&dma->lock);
	return NULL;
}

static void set_state(struct doca_dma *dma, enum doca_ctx_states next)
{
	enum doca_ctx_states prev = dma->state;

	dma->state = next;
	if (dma->state_cb)
		dma->state_cb(dma->ctx_user_data, &dma->ctx, prev, next);
}

uint8_t doca_pe_progress(struct doca_pe *pe)
{
	struct doca_dma *dma = pe->dma;
	struct doca_task *batch, *task;
	int count = 0, progressed = 0;

	if (dma == NULL)
		return 0;
	pthread_mutex_lock(&dma->lock);
	batch = dma->done_head;
	for (task = batch; task && count < SIM_COMPLETIONS_PER_PROGRESS - 1; task = task->next)
		count++;
	if (task) {
		dma->done_head = task->next;
		task->next = NULL;
		if (dma->done_head == NULL)
			dma->done_tail = NULL;
	} else {
		dma->done_head = dma->done_tail = NULL;
	}
	pthread_mutex_unlock(&dma->lock);
	/* Callbacks run without the lock: they free, resubmit and release buffers. */
	while (batch) {
		struct doca_task *next = batch->next;

		batch->submitted = 0;
		dma->inflight--;
		if (batch->status == DOCA_SUCCESS)
			dma->done_cb((struct doca_dma_task_memcpy *)batch, batch->user_data,
				     dma->ctx_user_data);
		else
			dma->err_cb((struct doca_dma_task_memcpy *)batch, batch->user_data,
				    dma->ctx_user_data);
		progressed = 1;
		batch = next;
	}
	if (dma->state == DOCA_CTX_STATE_STOPPING && dma->inflight == 0) {
		set_state(dma, DOCA_CTX_STATE_IDLE);
		progressed = 1;
	}
	return (uint8_t)progressed;
}

doca_error_t doca_dma_create(struct doca_dev *dev, struct doca_dma **dma)
{
	struct doca_dma *d;

	if (dev == NULL || dma == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	d = calloc(1, sizeof(*d));
	if (d == NULL)
		return DOCA_ERROR_NO_MEMORY;
	if (pthread_mutex_init(&d->lock, NULL) != 0 || pthread_cond_init(&d->wake, NULL) != 0) {
		free(d);
		return DOCA_ERROR_INITIALIZATION;
	}
	d->ctx.dma = d;
	d->dev = dev;
	d->state = DOCA_CTX_STATE_IDLE;
	*dma = d;
	return DOCA_SUCCESS;
}

static void stop_worker(struct doca_dma *dma)
{
	if (!dma->worker_running)
		return;
	pthread_mutex_lock(&dma->lock);
	dma->worker_exit = 1;
	pthread_cond_signal(&dma->wake);
	pthread_mutex_unlock(&dma->lock);
	pthread_join(dma->worker, NULL);
	dma->worker_running = 0;
}

doca_error_t doca_dma_destroy(struct doca_dma *dma)
{
	if (dma == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	if (dma->state != DOCA_CTX_STATE_IDLE)
		return DOCA_ERROR_IN_USE;
	stop_worker(dma);
	if (dma->pe)
		dma->pe->dma = NULL;
	pthread_cond_destroy(&dma->wake);
	pthread_mutex_destroy(&dma->lock);
	free(dma->tasks);
	free(dma);
	return DOCA_SUCCESS;
}

struct doca_ctx *doca_dma_as_ctx(struct doca_dma *dma)
{
	return dma ? &dma->ctx : NULL;
}

doca_error_t doca_dma_cap_get_max_num_tasks(struct doca_dma *dma, uint32_t *max_num_tasks)
{
	if (dma == NULL || max_num_tasks == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	*max_num_tasks = sim_max_tasks();
	return DOCA_SUCCESS;
}

doca_error_t doca_dma_cap_task_memcpy_is_supported(const struct doca_devinfo *devinfo)
{
	return devinfo ? DOCA_SUCCESS : DOCA_ERROR_INVALID_VALUE;
}

doca_error_t doca_dma_cap_task_memcpy_get_max_buf_size(const struct doca_devinfo *devinfo,
						       uint64_t *buf_size)
{
	if (devinfo == NULL || buf_size == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	*buf_size = sim_max_buf_size();
	return DOCA_SUCCESS;
}

doca_error_t doca_dma_cap_task_memcpy_get_max_buf_list_len(const struct doca_devinfo *devinfo,
							   uint32_t *max_buf_list_len)
{
	if (devinfo == NULL || max_buf_list_len == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	*max_buf_list_len = 1;
	return DOCA_SUCCESS;
}

doca_error_t doca_dma_task_memcpy_set_conf(struct doca_dma *dma,
					   doca_dma_task_memcpy_completion_cb_t task_completion_cb,
					   doca_dma_task_memcpy_completion_cb_t task_error_cb,
					   uint32_t num_memcpy_tasks)
{
	struct doca_dma_task_memcpy *tasks;
	uint32_t i;

	if (dma == NULL || task_completion_cb == NULL || task_error_cb == NULL ||
	    num_memcpy_tasks == 0 || num_memcpy_tasks > sim_max_tasks())
		return DOCA_ERROR_INVALID_VALUE;
	if (dma->state != DOCA_CTX_STATE_IDLE)
		return DOCA_ERROR_BAD_STATE;
	tasks = calloc(num_memcpy_tasks, sizeof(*tasks));
	if (tasks == NULL)
		return DOCA_ERROR_NO_MEMORY;
	free(dma->tasks);
	dma->tasks = tasks;
	dma->num_tasks = num_memcpy_tasks;
	dma->free_tasks = NULL;
	for (i = num_memcpy_tasks; i-- > 0;) {
		tasks[i].base.dma = dma;
		tasks[i].base.next = dma->free_tasks;
		dma->free_tasks = &tasks[i].base;
	}
	dma->done_cb = task_completion_cb;
	dma->err_cb = task_error_cb;
	return DOCA_SUCCESS;
}

doca_error_t doca_ctx_set_state_changed_cb(struct doca_ctx *ctx, doca_ctx_state_changed_callback_t cb)
{
	if (ctx == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	if (ctx->dma->state != DOCA_CTX_STATE_IDLE)
		return DOCA_ERROR_BAD_STATE;
	ctx->dma->state_cb = cb;
	return DOCA_SUCCESS;
}

doca_error_t doca_ctx_set_user_data(struct doca_ctx *ctx, union doca_data user_data)
{
	if (ctx == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	if (ctx->dma->state != DOCA_CTX_STATE_IDLE)
		return DOCA_ERROR_BAD_STATE;
	ctx->dma->ctx_user_data = user_data;
	return DOCA_SUCCESS;
}

doca_error_t doca_ctx_get_state(const struct doca_ctx *ctx, enum doca_ctx_states *state)
{
	if (ctx == NULL || state == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	*state = ctx->dma->state;
	return DOCA_SUCCESS;
}

doca_error_t doca_ctx_start(struct doca_ctx *ctx)
{
	struct doca_dma *dma;

	if (ctx == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	dma = ctx->dma;
	if (dma->pe == NULL)
		return DOCA_ERROR_NOT_CONNECTED;
	if (dma->state != DOCA_CTX_STATE_IDLE)
		return DOCA_ERROR_BAD_STATE;
	if (dma->tasks == NULL)
		return DOCA_ERROR_INVALID_VALUE;   /* no task configuration */
	if (!dma->worker_running) {
		dma->worker_exit = 0;
		if (pthread_create(&dma->worker, NULL, engine_worker, dma) != 0)
			return DOCA_ERROR_INITIALIZATION;
		dma->worker_running = 1;
	}
	set_state(dma, DOCA_CTX_STATE_RUNNING);
	return DOCA_SUCCESS;
}

doca_error_t doca_ctx_stop(struct doca_ctx *ctx)
{
	struct doca_dma *dma;

	if (ctx == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	dma = ctx->dma;
	if (dma->pe == NULL)
		return DOCA_ERROR_NOT_CONNECTED;
	if (dma->state == DOCA_CTX_STATE_IDLE)
		return DOCA_ERROR_BAD_STATE;
	if (dma->state == DOCA_CTX_STATE_STOPPING)
		return DOCA_ERROR_IN_PROGRESS;
	if (dma->inflight) {
		set_state(dma, DOCA_CTX_STATE_STOPPING);
		return DOCA_ERROR_IN_PROGRESS;
	}
	set_state(dma, DOCA_CTX_STATE_IDLE);
	return DOCA_SUCCESS;
}

doca_error_t doca_dma_task_memcpy_alloc_init(struct doca_dma *dma, const struct doca_buf *src,
					     struct doca_buf *dst, union doca_data user_data,
					     struct doca_dma_task_memcpy **task)
{
	struct doca_dma_task_memcpy *t;

	if (dma == NULL || task == NULL)
		return DOCA_ERROR_INVALID_VALUE;
	if (dma->free_tasks == NULL)
		return DOCA_ERROR_NO_MEMORY;
	t = (struct doca_dma_task_memcpy *)dma->free_tasks;
	dma->free_tasks = t->base.next;
	t->base.next = NULL;
	t->base.allocated = 1;
	t->base.status = DOCA_SUCCESS;
	t->base.user_data = user_data;
	t->src = (struct doca_buf *)src;
	t->dst = dst;
	*task = t;
	return DOCA_SUCCESS;
}

struct doca_task *doca_dma_task_memcpy_as_task(struct doca_dma_task_memcpy *task)
{
	return task ? &task->base : NULL;
}

const struct doca_buf *doca_dma_task_memcpy_get_src(const struct doca_dma_task_memcpy *task)
{
	return task->src;
}

struct doca_buf *doca_dma_task_memcpy_get_dst(const struct doca_dma_task_memcpy *task)
{
	return task->dst;
}

doca_error_t doca_task_submit(struct doca_task *task)
{
	struct doca_dma_task_memcpy *t = (struct doca_dma_task_memcpy *)task;
	struct doca_dma *dma;
	size_t room;

	if (task == NULL || !task->allocated || task->submitted)
		return DOCA_ERROR_INVALID_VALUE;
	dma = task->dma;
	if (dma->state != DOCA_CTX_STATE_RUNNING)
		return DOCA_ERROR_BAD_STATE;
	if (t->src == NULL || t->dst == NULL || t->src->refcount == 0 || t->dst->refcount == 0)
		return DOCA_ERROR_INVALID_VALUE;
	if (t->src->data_len > sim_max_buf_size())
		return DOCA_ERROR_TOO_BIG;
	room = (size_t)((t->dst->addr + t->dst->len) - (t->dst->data + t->dst->data_len));
	if (t->src->data_len > room)
		return DOCA_ERROR_INVALID_VALUE;
	if (t->src->mmap->from_export && t->dst->mmap->from_export)
		return DOCA_ERROR_NOT_SUPPORTED;   /* both ends on the host: not a DPU copy */
	if (t->dst->mmap->from_export &&
	    !(t->dst->mmap->permissions & DOCA_ACCESS_FLAG_PCI_READ_WRITE))
		return DOCA_ERROR_NOT_PERMITTED;   /* the host exported it read-only */
	if (!t->dst->mmap->from_export &&
	    !(t->dst->mmap->permissions & DOCA_ACCESS_FLAG_LOCAL_READ_WRITE))
		return DOCA_ERROR_NOT_PERMITTED;
	task->submitted = 1;
	dma->inflight++;
	pthread_mutex_lock(&dma->lock);
	task->next = NULL;
	if (dma->queue_tail)
		dma->queue_tail->next = task;
	else
		dma->queue_head = task;
	dma->queue_tail = task;
	pthread_cond_signal(&dma->wake);
	pthread_mutex_unlock(&dma->lock);
	return DOCA_SUCCESS;
}

void doca_task_free(struct doca_task *task)
{
	if (task == NULL || !task->allocated || task->submitted)
		return;
	task->allocated = 0;
	task->next = task->dma->free_tasks;
	task->dma->free_tasks = task;
}

doca_error_t doca_task_get_status(const struct doca_task *task)
{
	return task ? task->status : DOCA_ERROR_INVALID_VALUE;
}
