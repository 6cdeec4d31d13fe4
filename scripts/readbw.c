/* Memory bandwidth of T threads (each its own contiguous chunk of one buffer), for the CPU
 * decode target (issue 15: "≥ 70 % of the bandwidth that a plain copy reaches"):
 *   copy-libc  memcpy (glibc picks rep movsb / temporal or non-temporal stores by size),
 *              counted as STREAM does (bytes read + bytes written); -256M/-512M: smaller
 *              buffers (the old `fa bench --decode` probe sizes)
 *   copy-nt    AVX-512 loads + non-temporal stores (no read-for-ownership), read + written
 *   read       AVX-512 loads summed, bytes read
 *   read-pfK   the same with a software prefetch (t0/t1/t2/nta) K bytes ahead of each line
 * Every timed pass follows an untimed pass over another buffer larger than the caches.
 *   gcc -O2 -mavx512f -pthread -o readbw scripts/readbw.c
 *   taskset -c 0,1 ./readbw [threads=2] [MiB per buffer=1024] [reps=3] [small MiB=16]
 * The last argument adds read passes over a small buffer (like a 4k-key cache: 16 MiB) after
 * the same eviction. Prints one line per mode: GB/s (median of reps), best. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { COPY_LIBC, COPY_NT, READ, READ_PF };
struct job {
    char *src, *dst;
    size_t len;
    int mode, hint;
    size_t dist;
    float sink;
};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

#define PF(hint, p)                                                                            \
    do {                                                                                       \
        switch (hint) {                                                                        \
        case 0: _mm_prefetch((const char *)(p), _MM_HINT_T0); break;                           \
        case 1: _mm_prefetch((const char *)(p), _MM_HINT_T1); break;                           \
        case 2: _mm_prefetch((const char *)(p), _MM_HINT_T2); break;                           \
        default: _mm_prefetch((const char *)(p), _MM_HINT_NTA); break;                         \
        }                                                                                      \
    } while (0)

static float read_loop(const char *p, size_t len, int pf, int hint, size_t dist) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const char *end = p + len;
    for (const char *x = p; x + 256 <= end; x += 256) {
        if (pf && x + dist + 256 <= end) {
            PF(hint, x + dist);
            PF(hint, x + dist + 64);
            PF(hint, x + dist + 128);
            PF(hint, x + dist + 192);
        }
        a0 = _mm512_add_ps(a0, _mm512_load_ps((const float *)x));
        a1 = _mm512_add_ps(a1, _mm512_load_ps((const float *)(x + 64)));
        a2 = _mm512_add_ps(a2, _mm512_load_ps((const float *)(x + 128)));
        a3 = _mm512_add_ps(a3, _mm512_load_ps((const float *)(x + 192)));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

static void *work(void *arg) {
    struct job *j = arg;
    switch (j->mode) {
    case COPY_LIBC: memcpy(j->dst, j->src, j->len); break;
    case COPY_NT:
        for (size_t i = 0; i + 256 <= j->len; i += 256)
            for (int k = 0; k < 256; k += 64)
                _mm512_stream_ps((float *)(j->dst + i + k), _mm512_load_ps((const float *)(j->src + i + k)));
        _mm_sfence();
        break;
    case READ: j->sink = read_loop(j->src, j->len, 0, 0, 0); break;
    case READ_PF: j->sink = read_loop(j->src, j->len, 1, j->hint, j->dist); break;
    }
    return NULL;
}

static int threads;
/* One pass of `mode` over len bytes on `threads` threads; seconds. */
static double pass(int mode, char *src, char *dst, size_t len, int hint, size_t dist) {
    pthread_t t[64];
    struct job j[64];
    size_t chunk = (len / threads) & ~(size_t)4095;
    double t0 = now();
    for (int i = 0; i < threads; i++) {
        j[i] = (struct job){src + i * chunk, dst ? dst + i * chunk : NULL, chunk, mode, hint, dist, 0};
        pthread_create(&t[i], NULL, work, &j[i]);
    }
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    double s = now() - t0;
    volatile float keep = j[0].sink;
    (void)keep;
    return s;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    threads = argc > 1 ? atoi(argv[1]) : 2;
    size_t mib = argc > 2 ? atoi(argv[2]) : 1024;
    int reps = argc > 3 ? atoi(argv[3]) : 3;
    size_t small = argc > 4 ? atoi(argv[4]) : 16;
    size_t len = mib << 20;
    char *a = aligned_alloc(4096, len), *b = aligned_alloc(4096, len), *e = aligned_alloc(4096, len);
    memset(a, 1, len);
    memset(b, 2, len);
    memset(e, 3, len);
    struct { const char *name; int mode, hint; size_t dist, bytes_per; size_t len; } modes[] = {
        {"copy-libc", COPY_LIBC, 0, 0, 2, len},
        {"copy-nt", COPY_NT, 0, 0, 2, len},
        {"copy-libc-256M", COPY_LIBC, 0, 0, 2, (size_t)256 << 20},
        {"copy-nt-256M", COPY_NT, 0, 0, 2, (size_t)256 << 20},
        {"copy-libc-512M", COPY_LIBC, 0, 0, 2, (size_t)512 << 20},
        {"read", READ, 0, 0, 1, len},
        {"read-pf-t0-1k", READ_PF, 0, 1024, 1, len},
        {"read-pf-t1-2k", READ_PF, 1, 2048, 1, len},
        {"read-pf-t1-4k", READ_PF, 1, 4096, 1, len},
        {"read-pf-t1-8k", READ_PF, 1, 8192, 1, len},
        {"read-pf-t1-16k", READ_PF, 1, 16384, 1, len},
        {"read-pf-t2-4k", READ_PF, 2, 4096, 1, len},
        {"read-pf-t2-8k", READ_PF, 2, 8192, 1, len},
        {"read-pf-nta-2k", READ_PF, 3, 2048, 1, len},
        {"read-small", READ, 0, 0, 1, small << 20},
        {"read-small-pf-t1-4k", READ_PF, 1, 4096, 1, small << 20},
    };
    int n = sizeof modes / sizeof modes[0];
    printf("# readbw: %d threads, %zu MiB per buffer, %d reps (GB/s: median, best)\n", threads, mib, reps);
    double *gb = calloc(n * reps, sizeof(double));
    for (int r = 0; r < reps; r++)
        for (int m = 0; m < n; m++) {
            pass(READ, e, NULL, len, 0, 0); /* evict */
            size_t l = modes[m].len < len ? modes[m].len : len;
            double s = pass(modes[m].mode, a, b, l, modes[m].hint, modes[m].dist);
            gb[m * reps + r] = modes[m].bytes_per * (double)l / s / 1e9;
        }
    for (int m = 0; m < n; m++) {
        qsort(gb + m * reps, reps, sizeof(double), cmp);
        printf("%-22s %7.1f %7.1f\n", modes[m].name, gb[m * reps + reps / 2], gb[m * reps + reps - 1]);
    }
    return 0;
}
