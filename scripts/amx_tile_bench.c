/* The AMX forward's `Oᵀ += Vᵀ·Pᵀ` tile job (kernel/amx_task.rs ProductsJob) alone, in a loop,
 * with its operands (Vᵀ and P) starting on a cache line or `MIS` bytes past one: a tile row of
 * 64 bytes that straddles two lines costs every `tileloadd` twice the lines. Also the job with
 * Vᵀ stored tile by tile (layout 1) instead of row-major (layout 0). Linux, AMX-BF16 only.
 *   gcc -O2 -mamx-tile -mamx-bf16 -DMIS=0 -o amx_tile_bench scripts/amx_tile_bench.c
 *   gcc -O2 -mamx-tile -mamx-bf16 -DMIS=4 -o amx_tile_bench_mis scripts/amx_tile_bench.c
 *   taskset -c 0 ./amx_tile_bench
 * Prints time-stamp ticks per job call and per tdpbf16ps (the minimum over 20 repetitions),
 * for D = 128 and 256, 256 keys, and Oᵀ of 1, 8 or 40 panels (16 KiB to 1.25 MiB). */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#ifndef MIS
#define MIS 0
#endif

typedef struct {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int DV = 256, NK = 256;

/* vb: DV rows of NK bf16 (layout 0) or 16x32 tiles one after another (layout 1); pb: NK/32
 * chunks of two P tiles; o: DV rows of 32 floats. */
static void products(uint8_t *vb, uint8_t *pb, float *o, int layout) {
    int half = NK / 2, chunks = NK / 32;
    for (int cb = 0; cb < DV; cb += 32) {
        float *oc = o + cb * 32;
        _tile_loadd(0, oc, 128);
        _tile_loadd(1, oc + 16, 128);
        _tile_loadd(2, oc + 16 * 32, 128);
        _tile_loadd(3, oc + 16 * 32 + 16, 128);
        for (int kc = 0; kc < chunks; kc++) {
            uint8_t *v0, *v1;
            size_t vs;
            if (layout == 0) {
                v0 = vb + (size_t)(cb * half + kc * 16) * 4;
                v1 = v0 + 16 * half * 4;
                vs = 2 * NK;
            } else {
                v0 = vb + ((size_t)(cb / 16) * chunks + kc) * 1024;
                v1 = v0 + chunks * 1024;
                vs = 64;
            }
            uint8_t *p0 = pb + kc * 2 * 1024;
            _tile_loadd(4, v0, vs);
            _tile_loadd(5, v1, vs);
            _tile_loadd(6, p0, 64);
            _tile_loadd(7, p0 + 1024, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, oc, 128);
        _tile_stored(1, oc + 16, 128);
        _tile_stored(2, oc + 16 * 32, 128);
        _tile_stored(3, oc + 16 * 32 + 16, 128);
    }
}

int main(void) {
    /* arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) */
    if (syscall(SYS_arch_prctl, 0x1023, 18)) {
        perror("arch_prctl");
        return 1;
    }
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
    int panel_counts[] = {1, 8, 40};
    for (int d = 0; d < 2; d++) {
        DV = d ? 256 : 128;
        for (int pc = 0; pc < 3; pc++) {
            int panels = panel_counts[pc];
            uint8_t *vb = aligned_alloc(4096, DV * NK * 2 + 4096);
            uint8_t *pb = aligned_alloc(4096, NK * 32 * 2 + 4096);
            float *o = aligned_alloc(4096, (size_t)panels * DV * 32 * 4);
            /* Nonzero bf16 data (all-zero operands run faster). */
            for (int i = 0; i < DV * NK + 2048; i++) ((uint16_t *)vb)[i] = 0x3f00 + (rand() & 0xff);
            for (int i = 0; i < NK * 32 + 2048; i++) ((uint16_t *)pb)[i] = 0x3e00 + (rand() & 0xff);
            memset(o, 0, (size_t)panels * DV * 32 * 4);
            for (int layout = 0; layout < 2; layout++) {
                uint64_t best = ~0ull;
                int iters = 40 / panels + 1;
                for (int rep = 0; rep < 20; rep++) {
                    uint64_t t0 = __rdtsc();
                    for (int it = 0; it < iters; it++)
                        for (int p = 0; p < panels; p++)
                            products(vb + MIS, pb + MIS, o + (size_t)p * DV * 32, layout);
                    uint64_t t = __rdtsc() - t0;
                    if (t < best) best = t;
                }
                double calls = (double)iters * panels, dots = DV / 32 * NK / 32 * 4;
                printf("D %d, O %zu KiB, operands %d bytes past a line, layout %d: %.0f ticks/call, "
                       "%.1f ticks/tdpbf16ps\n",
                       DV, (size_t)panels * DV * 32 * 4 / 1024, MIS, layout, best / calls,
                       best / calls / dots);
            }
            free(vb);
            free(pb);
            free(o);
        }
    }
    _tile_release();
    return 0;
}
