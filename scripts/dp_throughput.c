/* Issue rate of AVX-512 `vfmadd231ps zmm` against AVX512-BF16 `vdpbf16ps zmm` on one core:
 * 12 independent accumulator chains of each (enough to hide either latency), ns per
 * instruction, three rounds. One `vdpbf16ps` does 32 multiply-adds, one FMA 16; so a kernel
 * gains from `vdpbf16ps` only if it issues at more than half the FMA's rate. On the GPU
 * machine's Xeon and on the development VM it issues at a quarter (docs/history/gpu-notes.md,
 * 2026-12-04).
 *
 *   gcc -O2 -march=sapphirerapids -static -o dp_throughput scripts/dp_throughput.c
 *   taskset -c 0 ./dp_throughput
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

int main(void) {
    const long n_iter = 20000000;
    /* Operands that keep the values finite: x·1 + 0 and acc + 0·0. */
    __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_set1_ps(0.0f);
    __m512bh bz = (__m512bh)_mm512_set1_epi32(0);
#define DECL(i) __m512 a##i = _mm512_set1_ps(i);
    CHAINS(DECL)
    for (int round = 0; round < 3; round++) {
        double t = now();
#define FMA(i) a##i = _mm512_fmadd_ps(a##i, one, zero);
        for (long n = 0; n < n_iter; n++) { CHAINS(FMA) }
        double t_fma = now() - t;
        t = now();
#define DP(i) a##i = _mm512_dpbf16_ps(a##i, bz, bz);
        for (long n = 0; n < n_iter; n++) { CHAINS(DP) }
        double t_dp = now() - t;
        printf("12 chains: fma %.3f ns/op, dp %.3f ns/op\n", t_fma / (n_iter * 12) * 1e9,
               t_dp / (n_iter * 12) * 1e9);
    }
    /* Use every chain, so that none is optimised away. */
#define SUM(i) + a##i
    float out[16];
    _mm512_storeu_ps(out, zero CHAINS(SUM));
    printf("check %g\n", out[0]);
    return 0;
}
