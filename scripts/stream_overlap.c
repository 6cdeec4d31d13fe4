/* How a streaming loop's per-core read rate depends on the arithmetic done per cache line and
 * on software prefetch: the question behind the CPU decode's per-core bound (issue 15,
 * docs/history/gpu-notes.md, 2026-12-04). K and V are laid out like a padded bf16 decode cache
 * ([keys][8 heads][128], 2 KiB per key, 256 B per key and head) and read in 64-key tiles.
 *   seq         K tile then V tile, each in address order
 *   head        per tile, head after head (256 B every 2 KiB), as the decode's Q·Kᵀ reads
 *   +phase      `prefetcht1` of the V tile while K is read and of the next K tile while V
 *               is read, line by line in the same order (the decode's `phase` schedule)
 *   +pfN        `prefetcht1` N bytes ahead in the same stream
 *   +wN         N independent FMAs per line (8 accumulators in registers), the "compute"
 * With MiB per buffer below 64 the buffers are read repeatedly (an in-cache rate, i.e. the
 * arithmetic's own rate); otherwise each pass reads 2 × MiB from DRAM. DAZ/FTZ are set: the
 * FMAs run on raw cache bytes, and denormal assists would otherwise dominate.
 *   gcc -O2 -march=sapphirerapids -static -pthread -o stream_overlap scripts/stream_overlap.c
 *   taskset -c 0 ./stream_overlap [MiB per buffer=1024] [threads=1] [rounds=1] */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define HEADS 8
#define ROW 256
#define KEY_BYTES (HEADS * ROW)
#define TILE 64

enum { SEQ, SEQ_PF, HEAD, HEAD_PHASE };

static size_t nkeys, per_thread;  /* keys in all; per thread, whole tiles */
static uint8_t *kbuf, *vbuf;
static int reps = 1, pattern, work, dist;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct { __m512i sum; __m512 f[8]; } Acc;

static inline __attribute__((always_inline)) void row(Acc *c, const uint8_t *p) {
    for (int l = 0; l < ROW / 64; l++) {
        __m512i x = _mm512_load_si512((const void *)(p + 64 * l));
        c->sum = _mm512_add_epi32(c->sum, x);
        __m512 xf = _mm512_castsi512_ps(x);
        for (int w = 0; w < work; w += 8) {  /* spelled out: GCC keeps them in registers */
            c->f[0] = _mm512_fmadd_ps(xf, xf, c->f[0]), c->f[1] = _mm512_fmadd_ps(xf, xf, c->f[1]);
            c->f[2] = _mm512_fmadd_ps(xf, xf, c->f[2]), c->f[3] = _mm512_fmadd_ps(xf, xf, c->f[3]);
            c->f[4] = _mm512_fmadd_ps(xf, xf, c->f[4]), c->f[5] = _mm512_fmadd_ps(xf, xf, c->f[5]);
            c->f[6] = _mm512_fmadd_ps(xf, xf, c->f[6]), c->f[7] = _mm512_fmadd_ps(xf, xf, c->f[7]);
        }
    }
}

static inline __attribute__((always_inline)) void prefetch_row(const uint8_t *p) {
    for (int i = 0; i < ROW; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T1);
}

static void stream(size_t k0, size_t k1, Acc *out) {
    Acc acc = *out, *c = &acc;  /* a local copy: kept in registers */
    for (size_t t = k0; t < k1; t += TILE) {
        uint8_t *kt = kbuf + t * KEY_BYTES, *vt = vbuf + t * KEY_BYTES;
        uint8_t *kn = t + TILE < k1 ? kt + TILE * KEY_BYTES : kt;
        switch (pattern) {
        case SEQ:
        case SEQ_PF:
            for (int pass = 0; pass < 2; pass++) {
                uint8_t *b = pass ? vt : kt;
                for (int k = 0; k < TILE * KEY_BYTES; k += ROW) {
                    if (pattern == SEQ_PF) prefetch_row(b + k + dist);
                    row(c, b + k);
                }
            }
            break;
        case HEAD:
        case HEAD_PHASE:
            for (int pass = 0; pass < 2; pass++) {
                uint8_t *b = pass ? vt : kt, *pf = pass ? kn : vt;
                for (int h = 0; h < HEADS; h++)
                    for (int k = 0; k < TILE; k++) {
                        if (pattern == HEAD_PHASE) prefetch_row(pf + k * KEY_BYTES + h * ROW);
                        row(c, b + k * KEY_BYTES + h * ROW);
                    }
            }
            break;
        }
    }
    *out = acc;
}

typedef struct { int id; double dt; Acc acc; pthread_barrier_t *bar; } Job;

static void *worker(void *p) {
    Job *j = p;
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(j->id, &s);
    sched_setaffinity(0, sizeof s, &s);
    _mm_setcsr(_mm_getcsr() | 0x8040);  /* DAZ | FTZ */
    memset(&j->acc, 0, sizeof j->acc);
    pthread_barrier_wait(j->bar);
    double t0 = now();
    for (int r = 0; r < reps; r++) stream(per_thread * j->id, per_thread * (j->id + 1), &j->acc);
    j->dt = now() - t0;
    return 0;
}

int main(int argc, char **argv) {
    double mib = argc > 1 ? atof(argv[1]) : 1024;
    int nth = argc > 2 ? atoi(argv[2]) : 1, rounds = argc > 3 ? atoi(argv[3]) : 1;
    if (nth < 1 || nth > 64) return 1;
    nkeys = (size_t)(mib * (1 << 20)) / KEY_BYTES / TILE * TILE;
    per_thread = nkeys / nth / TILE * TILE;
    if (per_thread == 0) return 1;
    reps = mib < 64 ? (int)(2048 / mib) : 1;
    size_t bytes = nkeys * KEY_BYTES + (1 << 20);
    kbuf = aligned_alloc(4096, bytes);
    vbuf = aligned_alloc(4096, bytes);
    if (!kbuf || !vbuf) return 1;
    for (size_t i = 0; i < bytes; i += 8) {
        *(uint64_t *)(kbuf + i) = i * 7;
        *(uint64_t *)(vbuf + i) = i * 5;
    }
    static const struct { const char *name; int pattern, work, dist; } cfg[] = {
        {"seq", SEQ, 0, 0},          {"seq+w16", SEQ, 16, 0},
        {"seq+w32", SEQ, 32, 0},     {"seq+pf4k+w32", SEQ_PF, 32, 4096},
        {"head", HEAD, 0, 0},        {"head+w16", HEAD, 16, 0},
        {"head+phase+w16", HEAD_PHASE, 16, 0}, {"head+w24", HEAD, 24, 0},
        {"head+phase+w24", HEAD_PHASE, 24, 0}, {"head+w32", HEAD, 32, 0},
        {"head+phase+w32", HEAD_PHASE, 32, 0},
    };
    for (int r = 0; r < rounds; r++)
        for (size_t i = 0; i < sizeof cfg / sizeof cfg[0]; i++) {
            pattern = cfg[i].pattern, work = cfg[i].work, dist = cfg[i].dist;
            pthread_t th[64];
            Job jobs[64];
            pthread_barrier_t bar;
            pthread_barrier_init(&bar, 0, nth);
            for (int t = 0; t < nth; t++) {
                jobs[t] = (Job){.id = t, .bar = &bar};
                pthread_create(&th[t], 0, worker, &jobs[t]);
            }
            double dt = 0;
            long sink = 0;
            for (int t = 0; t < nth; t++) {
                pthread_join(th[t], 0);
                if (jobs[t].dt > dt) dt = jobs[t].dt;
                sink += _mm512_reduce_add_epi32(jobs[t].acc.sum) +
                        (long)_mm512_reduce_add_ps(jobs[t].acc.f[0]);
            }
            pthread_barrier_destroy(&bar);
            double read = 2.0 * reps * per_thread * nth * KEY_BYTES;
            printf("round %d %-16s %7.2f GB/s (%ld)\n", r, cfg[i].name, read / dt / 1e9, sink & 1);
            fflush(stdout);
        }
    return 0;
}
