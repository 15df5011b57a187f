/*
 * bluecache zero-copy ioctl ABI, version 1.
 *
 * Issue these on a file descriptor of a file under the bluecache mount (e.g. /mnt/kv-cache).
 * The request names client memory; hostd hands it to the cache daemon's DMA engine, which moves
 * the bytes directly between that memory and the cache. hostd copies no payload byte.
 *
 *   STORE  the memory becomes the file's whole content, atomically (readers of the file see the
 *          old content or the new one). Open the file for writing; to publish under a final name
 *          atomically, STORE into a temporary name and rename(2) it.
 *   LOAD   up to `length` bytes of the file from `file_offset` into the memory.
 *   QUERY  the file's size, tier and CRC32C, and hostd's copy counters.
 *
 * Memory kinds:
 *   MEMFD     a memfd (or other shmem fd) in the caller's fd table, sealed with F_SEAL_SHRINK
 *             (memfd_create(..., MFD_ALLOW_SEALING); fcntl(F_ADD_SEALS, F_SEAL_SHRINK)).
 *   DMABUF    a dma-buf fd in the caller's fd table (host-mappable in embedded mode).
 *   CUDA_IPC  a cudaIpcMemHandle_t of the caller's device allocation; mem_offset is relative to
 *             the allocation's base.
 * Fds are taken from the calling process with pidfd_getfd(2): a caller can only name its own.
 *
 * Errors (errno): EINVAL bad version/size/kind/flags/non-zero reserved bytes or overflow;
 * EBADF the fd is not open in the caller, or the file is not open for writing (STORE) or
 * reading (LOAD); EFAULT the span is outside the memory; EPERM the caller's fd could not be
 * taken; EOPNOTSUPP the memory kind is not supported by the engine in use; ENOTTY unknown
 * command. A failed STORE leaves the file's content unchanged.
 */
#ifndef BLUECACHE_IOCTL_H
#define BLUECACHE_IOCTL_H

#include <linux/ioctl.h>
#include <stdint.h>

#define BLUECACHE_IOCTL_VERSION 1
#define BLUECACHE_IOC_MAGIC 0xBC

enum bluecache_mem_kind {
	BLUECACHE_MEM_MEMFD = 1,
	BLUECACHE_MEM_DMABUF = 2,
	BLUECACHE_MEM_CUDA_IPC = 3,
};

enum bluecache_tier {
	BLUECACHE_TIER_DRAM = 1,
	BLUECACHE_TIER_NVME = 2,
};

struct bluecache_ioc_xfer {          /* STORE and LOAD: 256 bytes */
	uint32_t version;            /* in: BLUECACHE_IOCTL_VERSION */
	uint32_t struct_size;        /* in: sizeof(struct bluecache_ioc_xfer) */
	uint32_t mem_kind;           /* in: enum bluecache_mem_kind */
	int32_t fd;                  /* in: MEMFD, DMABUF: the caller's fd */
	uint64_t mem_offset;         /* in: where in the memory the bytes start */
	uint64_t length;             /* in: STORE: the new content's size; LOAD: at most this */
	uint64_t file_offset;        /* in: LOAD: where in the file to start; STORE: 0 */
	uint64_t flags;              /* in: 0 */
	uint8_t cuda_ipc_handle[64]; /* in: CUDA_IPC */
	uint64_t result_length;      /* out: bytes moved */
	uint64_t file_size;          /* out: the file's size after the call */
	uint8_t reserved[128];       /* in: zero */
};

struct bluecache_ioc_query {         /* QUERY: 64 bytes */
	uint32_t version;            /* in: BLUECACHE_IOCTL_VERSION */
	uint32_t struct_size;        /* in: sizeof(struct bluecache_ioc_query) */
	uint64_t file_size;          /* out */
	uint32_t tiers;              /* out: enum bluecache_tier bits holding the content */
	uint32_t crc32c;             /* out: CRC32C of the whole content */
	uint64_t hostd_bytes_copied; /* out: payload bytes hostd has copied itself (POSIX path) */
	uint64_t zero_copy_bytes;    /* out: bytes moved by ioctls so far */
	uint8_t reserved[24];        /* in: zero */
};

#define BLUECACHE_IOC_STORE _IOWR(BLUECACHE_IOC_MAGIC, 1, struct bluecache_ioc_xfer)
#define BLUECACHE_IOC_LOAD  _IOWR(BLUECACHE_IOC_MAGIC, 2, struct bluecache_ioc_xfer)
#define BLUECACHE_IOC_QUERY _IOWR(BLUECACHE_IOC_MAGIC, 3, struct bluecache_ioc_query)

#endif
