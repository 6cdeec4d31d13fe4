/* Peak f32 FMA rate of one thread: 12 independent FMA chains (enough to cover the latency of
 * two FMA pipes), no memory traffic. Run one copy per core at once to see whether two CPUs are
 * separate cores (each keeps its rate) or one core's two hyperthreads (each gets half).
 *   gcc -O2 -mavx2 -mfma    -o fma_peak scripts/fma_peak.c      (8-lane vectors)
 *   gcc -O2 -mavx512f       -o fma_peak scripts/fma_peak.c      (16-lane vectors)
 * Prints GFLOP/s (2 FLOPs per lane per FMA) for three runs of 0.2–0.5 s. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#ifdef __AVX512F__
typedef __m512 vec;
#define LANES 16
#define SPLAT _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define FIRST(v) _mm512_reduce_add_ps(v)
#define KEEP "+v"
#else
typedef __m256 vec;
#define LANES 8
#define SPLAT _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define FIRST(v) ((v)[0])
#define KEEP "+x"
#endif

int main(void) {
    vec a0 = SPLAT(0.1f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0,
        a8 = a0, a9 = a0, a10 = a0, a11 = a0;
    const vec x = SPLAT(0.999999f), y = SPLAT(1e-7f);
    for (int rep = 0; rep < 3; rep++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        const long n = 100000000;
        for (long i = 0; i < n; i++) {
            a0 = FMA(a0, x, y); a1 = FMA(a1, x, y); a2 = FMA(a2, x, y); a3 = FMA(a3, x, y);
            a4 = FMA(a4, x, y); a5 = FMA(a5, x, y); a6 = FMA(a6, x, y); a7 = FMA(a7, x, y);
            a8 = FMA(a8, x, y); a9 = FMA(a9, x, y); a10 = FMA(a10, x, y); a11 = FMA(a11, x, y);
            /* Keeps the twelve chains in registers and in this order. */
            __asm__ volatile("" : KEEP(a0), KEEP(a1), KEEP(a2), KEEP(a3), KEEP(a4), KEEP(a5),
                                  KEEP(a6), KEEP(a7), KEEP(a8), KEEP(a9), KEEP(a10), KEEP(a11));
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
        printf("%.1f GFLOP/s per thread (%.3f s, check %g)\n", n * 12.0 * 2 * LANES / s / 1e9, s,
               (double)(FIRST(a0) + FIRST(a11)));
    }
    return 0;
}
