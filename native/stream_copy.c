/*
 * The loopback engine's copy into the store: memcpy with non-temporal (streaming) stores.
 *
 * A chunk written into the DRAM tier is not read again soon (write-behind and loads come
 * later), yet a plain memcpy first reads every destination line into the cache (read for
 * ownership) and evicts other lines to hold it. Streaming stores write the lines out without
 * that. glibc switches to them only past a threshold scaled from the L3 size (190 MB on the
 * 2-core Xeon VM, with its 480 MiB L3), far above the 1 MiB of a FUSE write. Measured on that
 * VM, 8 llm-d writers through the mount: bluecached 0.25 -> 0.18 CPU-s per GiB stored
 * (docs/benchmarks/mount.md).
 *
 * x86-64 only (SSE2 is part of the base ISA); elsewhere, e.g. on a DPU's Arm cores where the
 * DOCA engine does the copying anyway, this is memcpy.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

void bc_stream_copy(void *dst_, const void *src_, size_t n)
{
#if defined(__x86_64__)
    char *dst = dst_;
    const char *src = src_;
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15; /* streaming stores want 16-byte alignment */
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, src += 64, dst += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    _mm_sfence(); /* streaming stores are weakly ordered: visible before the copy "ends" */
    memcpy(dst, src, n);
#else
    memcpy(dst_, src_, n);
#endif
}
