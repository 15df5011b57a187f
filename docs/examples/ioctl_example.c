/*
 * Store a buffer as a file of the bluecache mount and load it back, with no copy by hostd.
 * Build: cc -I hostd/include -o ioctl_example docs/examples/ioctl_example.c
 * Run:   ./ioctl_example /mnt/kv-cache/example.bin
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "bluecache_ioctl.h"

#define SIZE (32u << 20) /* one 256-token KV block of Llama-3.1-8B */

static int shared_buffer(size_t size, unsigned char **map)
{
	int fd = memfd_create("kv-block", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0 || ftruncate(fd, size) < 0 ||
	    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) < 0)
		return -1;
	*map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	return *map == MAP_FAILED ? -1 : fd;
}

static struct bluecache_ioc_xfer memfd_request(int memfd, uint64_t length)
{
	struct bluecache_ioc_xfer x;
	memset(&x, 0, sizeof(x)); /* reserved bytes must be zero */
	x.version = BLUECACHE_IOCTL_VERSION;
	x.struct_size = sizeof(x);
	x.mem_kind = BLUECACHE_MEM_MEMFD;
	x.fd = memfd;
	x.length = length;
	return x;
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: %s FILE-ON-THE-MOUNT\n", argv[0]);
		return 2;
	}
	unsigned char *src, *dst;
	int src_fd = shared_buffer(SIZE, &src), dst_fd = shared_buffer(SIZE, &dst);
	if (src_fd < 0 || dst_fd < 0) {
		perror("memfd");
		return 1;
	}
	for (size_t i = 0; i < SIZE; i++)
		src[i] = (unsigned char)(i * 7 + i / 4096);

	/* STORE into a temporary name, then rename: readers never see a partial block. */
	char tmp[4096];
	snprintf(tmp, sizeof(tmp), "%s.tmp", argv[1]);
	int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	struct bluecache_ioc_xfer x = memfd_request(src_fd, SIZE);
	if (fd < 0 || ioctl(fd, BLUECACHE_IOC_STORE, &x) < 0 || rename(tmp, argv[1]) < 0) {
		perror("store");
		return 1;
	}
	close(fd);

	fd = open(argv[1], O_RDONLY);
	x = memfd_request(dst_fd, SIZE);
	if (fd < 0 || ioctl(fd, BLUECACHE_IOC_LOAD, &x) < 0) {
		perror("load");
		return 1;
	}

	struct bluecache_ioc_query q;
	memset(&q, 0, sizeof(q));
	q.version = BLUECACHE_IOCTL_VERSION;
	q.struct_size = sizeof(q);
	if (ioctl(fd, BLUECACHE_IOC_QUERY, &q) < 0) {
		perror("query");
		return 1;
	}
	close(fd);
	int same = x.result_length == SIZE && memcmp(src, dst, SIZE) == 0;
	printf("stored and loaded %llu bytes: %s; size %llu, crc32c %08x, hostd copied %llu bytes\n",
	       (unsigned long long)x.result_length, same ? "identical" : "DIFFERENT",
	       (unsigned long long)q.file_size, q.crc32c,
	       (unsigned long long)q.hostd_bytes_copied);
	return same ? 0 : 1;
}
