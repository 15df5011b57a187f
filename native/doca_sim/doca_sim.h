/*
 * The DOCA API subset bluecache calls, as the DOCA API simulator (doca_sim.c) implements it.
 *
 * Written from NVIDIA's public DOCA 2.10 / 3.0 reference (doca_types.h, doca_error.h,
 * doca_dev.h, doca_mmap.h, doca_buf.h, doca_buf_inventory.h, doca_pe.h, doca_ctx.h,
 * doca_dma.h): names, enum values, argument types and error codes are theirs, so a program
 * compiled or bound against this subset runs against the real libraries unchanged. It is a
 * SIMULATOR: no BlueField is involved.
 */
#ifndef BLUECACHE_DOCA_SIM_H
#define BLUECACHE_DOCA_SIM_H

#include <stddef.h>
#include <stdint.h>

typedef enum doca_error {
	DOCA_SUCCESS = 0,
	DOCA_ERROR_UNKNOWN = 1,
	DOCA_ERROR_NOT_PERMITTED = 2,
	DOCA_ERROR_IN_USE = 3,
	DOCA_ERROR_NOT_SUPPORTED = 4,
	DOCA_ERROR_AGAIN = 5,
	DOCA_ERROR_INVALID_VALUE = 6,
	DOCA_ERROR_NO_MEMORY = 7,
	DOCA_ERROR_INITIALIZATION = 8,
	DOCA_ERROR_TIME_OUT = 9,
	DOCA_ERROR_SHUTDOWN = 10,
	DOCA_ERROR_CONNECTION_RESET = 11,
	DOCA_ERROR_CONNECTION_ABORTED = 12,
	DOCA_ERROR_CONNECTION_INPROGRESS = 13,
	DOCA_ERROR_NOT_CONNECTED = 14,
	DOCA_ERROR_NO_LOCK = 15,
	DOCA_ERROR_NOT_FOUND = 16,
	DOCA_ERROR_IO_FAILED = 17,
	DOCA_ERROR_BAD_STATE = 18,
	DOCA_ERROR_UNSUPPORTED_VERSION = 19,
	DOCA_ERROR_OPERATING_SYSTEM = 20,
	DOCA_ERROR_DRIVER = 21,
	DOCA_ERROR_UNEXPECTED = 22,
	DOCA_ERROR_ALREADY_EXIST = 23,
	DOCA_ERROR_FULL = 24,
	DOCA_ERROR_EMPTY = 25,
	DOCA_ERROR_IN_PROGRESS = 26,
	DOCA_ERROR_TOO_BIG = 27,
	DOCA_ERROR_AUTHENTICATION = 28,
	DOCA_ERROR_BAD_CONFIG = 29,
	DOCA_ERROR_SKIPPED = 30,
} doca_error_t;

union doca_data {
	void *ptr;
	uint64_t u64;
};

enum doca_access_flag {
	DOCA_ACCESS_FLAG_LOCAL_READ_ONLY = 0,
	DOCA_ACCESS_FLAG_LOCAL_READ_WRITE = (1 << 0),
	DOCA_ACCESS_FLAG_RDMA_READ = (1 << 1),
	DOCA_ACCESS_FLAG_RDMA_WRITE = (1 << 2),
	DOCA_ACCESS_FLAG_RDMA_ATOMIC = (1 << 3),
	DOCA_ACCESS_FLAG_PCI_READ_ONLY = (1 << 4),
	DOCA_ACCESS_FLAG_PCI_READ_WRITE = (1 << 5),
	DOCA_ACCESS_FLAG_PCI_RELAXED_ORDERING = (1 << 6),
};

enum doca_ctx_states {
	DOCA_CTX_STATE_IDLE = 0,
	DOCA_CTX_STATE_STARTING = 1,
	DOCA_CTX_STATE_RUNNING = 2,
	DOCA_CTX_STATE_STOPPING = 3,
};

#define DOCA_DEVINFO_PCI_ADDR_SIZE 13

struct doca_devinfo;
struct doca_dev;
struct doca_mmap;
struct doca_buf;
struct doca_buf_inventory;
struct doca_pe;
struct doca_ctx;
struct doca_task;
struct doca_dma;
struct doca_dma_task_memcpy;

typedef void (*doca_ctx_state_changed_callback_t)(const union doca_data user_data,
						  struct doca_ctx *ctx,
						  enum doca_ctx_states prev_state,
						  enum doca_ctx_states next_state);
typedef void (*doca_dma_task_memcpy_completion_cb_t)(struct doca_dma_task_memcpy *task,
						     union doca_data task_user_data,
						     union doca_data ctx_user_data);

/* doca_version.h */
const char *doca_version_runtime(void);

/* doca_error.h */
const char *doca_error_get_name(doca_error_t error);
const char *doca_error_get_descr(doca_error_t error);

/* doca_dev.h */
doca_error_t doca_devinfo_create_list(struct doca_devinfo ***dev_list, uint32_t *nb_devs);
doca_error_t doca_devinfo_destroy_list(struct doca_devinfo **dev_list);
doca_error_t doca_devinfo_get_pci_addr_str(const struct doca_devinfo *devinfo, char *pci_addr_str);
doca_error_t doca_devinfo_is_equal_pci_addr(const struct doca_devinfo *devinfo,
					    const char *pci_addr_str, uint8_t *is_equal);
doca_error_t doca_dev_open(struct doca_devinfo *devinfo, struct doca_dev **dev);
doca_error_t doca_dev_close(struct doca_dev *dev);
struct doca_devinfo *doca_dev_as_devinfo(const struct doca_dev *dev);

/* doca_mmap.h */
doca_error_t doca_mmap_create(struct doca_mmap **mmap);
doca_error_t doca_mmap_destroy(struct doca_mmap *mmap);
doca_error_t doca_mmap_start(struct doca_mmap *mmap);
doca_error_t doca_mmap_stop(struct doca_mmap *mmap);
doca_error_t doca_mmap_add_dev(struct doca_mmap *mmap, struct doca_dev *dev);
doca_error_t doca_mmap_set_permissions(struct doca_mmap *mmap, uint32_t access_mask);
doca_error_t doca_mmap_set_memrange(struct doca_mmap *mmap, void *addr, size_t len);
doca_error_t doca_mmap_set_dmabuf_memrange(struct doca_mmap *mmap, int dmabuf_fd, void *addr,
					   size_t dmabuf_offset, size_t len);
doca_error_t doca_mmap_get_memrange(const struct doca_mmap *mmap, void **addr, size_t *len);
doca_error_t doca_mmap_export_pci(struct doca_mmap *mmap, const struct doca_dev *dev,
				  const void **export_desc, size_t *export_desc_len);
doca_error_t doca_mmap_create_from_export(const union doca_data *user_data,
					  const void *export_desc, size_t export_desc_len,
					  struct doca_dev *dev, struct doca_mmap **mmap);

/* doca_buf_inventory.h, doca_buf.h */
doca_error_t doca_buf_inventory_create(size_t num_elements, struct doca_buf_inventory **inventory);
doca_error_t doca_buf_inventory_destroy(struct doca_buf_inventory *inventory);
doca_error_t doca_buf_inventory_start(struct doca_buf_inventory *inventory);
doca_error_t doca_buf_inventory_stop(struct doca_buf_inventory *inventory);
doca_error_t doca_buf_inventory_get_num_free_elements(const struct doca_buf_inventory *inventory,
						      uint32_t *num_of_free_elements);
doca_error_t doca_buf_inventory_buf_get_by_args(struct doca_buf_inventory *inventory,
						struct doca_mmap *mmap, void *addr, size_t len,
						void *data, size_t data_len, struct doca_buf **buf);
doca_error_t doca_buf_dec_refcount(struct doca_buf *buf, uint16_t *refcount);
doca_error_t doca_buf_get_data(const struct doca_buf *buf, void **data);
doca_error_t doca_buf_get_data_len(const struct doca_buf *buf, size_t *data_len);
doca_error_t doca_buf_set_data(struct doca_buf *buf, void *data, size_t data_len);

/* doca_pe.h */
doca_error_t doca_pe_create(struct doca_pe **pe);
doca_error_t doca_pe_destroy(struct doca_pe *pe);
uint8_t doca_pe_progress(struct doca_pe *pe);
doca_error_t doca_pe_connect_ctx(struct doca_pe *pe, struct doca_ctx *ctx);
doca_error_t doca_pe_get_num_inflight_tasks(const struct doca_pe *pe, size_t *num_inflight_tasks);
doca_error_t doca_task_submit(struct doca_task *task);
void doca_task_free(struct doca_task *task);
doca_error_t doca_task_get_status(const struct doca_task *task);

/* doca_ctx.h */
doca_error_t doca_ctx_start(struct doca_ctx *ctx);
doca_error_t doca_ctx_stop(struct doca_ctx *ctx);
doca_error_t doca_ctx_get_state(const struct doca_ctx *ctx, enum doca_ctx_states *state);
doca_error_t doca_ctx_set_state_changed_cb(struct doca_ctx *ctx, doca_ctx_state_changed_callback_t cb);
doca_error_t doca_ctx_set_user_data(struct doca_ctx *ctx, union doca_data user_data);

/* doca_dma.h */
doca_error_t doca_dma_create(struct doca_dev *dev, struct doca_dma **dma);
doca_error_t doca_dma_destroy(struct doca_dma *dma);
struct doca_ctx *doca_dma_as_ctx(struct doca_dma *dma);
doca_error_t doca_dma_cap_get_max_num_tasks(struct doca_dma *dma, uint32_t *max_num_tasks);
doca_error_t doca_dma_cap_task_memcpy_is_supported(const struct doca_devinfo *devinfo);
doca_error_t doca_dma_cap_task_memcpy_get_max_buf_size(const struct doca_devinfo *devinfo,
						       uint64_t *buf_size);
doca_error_t doca_dma_cap_task_memcpy_get_max_buf_list_len(const struct doca_devinfo *devinfo,
							   uint32_t *max_buf_list_len);
doca_error_t doca_dma_task_memcpy_set_conf(struct doca_dma *dma,
					   doca_dma_task_memcpy_completion_cb_t task_completion_cb,
					   doca_dma_task_memcpy_completion_cb_t task_error_cb,
					   uint32_t num_memcpy_tasks);
doca_error_t doca_dma_task_memcpy_alloc_init(struct doca_dma *dma, const struct doca_buf *src,
					     struct doca_buf *dst, union doca_data user_data,
					     struct doca_dma_task_memcpy **task);
struct doca_task *doca_dma_task_memcpy_as_task(struct doca_dma_task_memcpy *task);
const struct doca_buf *doca_dma_task_memcpy_get_src(const struct doca_dma_task_memcpy *task);
struct doca_buf *doca_dma_task_memcpy_get_dst(const struct doca_dma_task_memcpy *task);

#endif
