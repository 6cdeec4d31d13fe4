/*
 * flash-attention-rs from C: a small GQA causal problem on the CPU, in f32 and in bf16 (as
 * uint16_t bits), checked against a naive attention written here; then a bad call, checked
 * for its error code and message; then the same K/V read as a padded KV cache
 * (fa_forward_cache_cpu, FA_KV_CACHE_INIT) with every key used, and a used length past the
 * cache refused; then a paged cache's block walk built by fa_block_walk (API version 4)
 * against the walk written out by hand, a bad table refused with the walk untouched, and a
 * walk refused where it does not belong; and the backward (fa_backward_cpu, API version 6):
 * the f32 problem's gradients against a naive backward written here, and a call without
 * the LSE refused with the gradients untouched. Exits non-zero on any failure.
 *
 * Build (from the repository root, after `cargo build -p fa-capi`):
 *   cc examples/c/forward_cpu.c -Iinclude target/debug/libflash_attention_rs.a \
 *      -lpthread -ldl -lm -o forward_cpu && ./forward_cpu
 *
 * Error bound: the normwise relative error ||o - ref||_2 / ||ref||_2 against a double
 * precision attention of the same (rounded) inputs is at most 1e-5 for f32 and 1e-2 for
 * bf16 (whose outputs are rounded to 8 significant bits, unit roundoff 2^-9 ~ 2e-3); the
 * LSE is within 1e-4 absolute in both. The f32 gradients are within 1e-5 normwise.
 */
#include "flash_attention_rs.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { BATCH = 2, SQ = 5, SK = 7, HQ = 4, HKV = 2, D = 16 };

static int failures = 0;

static void check(int ok, const char *what) {
    printf("%s: %s\n", ok ? "ok  " : "FAIL", what);
    if (!ok) failures++;
}

/* A fixed-seed generator, so every run checks the same numbers. */
static uint64_t state = 0x9e3779b97f4a7c15ull;
static float uniform(void) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((state >> 40) / 16777216.0) * 2.0f - 1.0f;
}

/* bf16 <-> f32 through the bits (round to nearest even; the inputs are finite). */
static uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* Element offset of (b, s, h, d) under a tensor's strides. */
static size_t at(const FaTensor *t, int b, int s, int h, int d) {
    return (size_t)(b * t->stride_batch + s * t->stride_seq + h * t->stride_head + d);
}

/* Naive attention in double: o[b, i, h, :] and lse[b, h, i], causal aligned bottom-right. */
static void naive(const float *q, const float *k, const float *v, const FaTensor *tq,
                  const FaTensor *tk, double *o, double *lse) {
    double scale = 1.0 / sqrt((double)D);
    for (int b = 0; b < BATCH; b++)
        for (int h = 0; h < HQ; h++)
            for (int i = 0; i < SQ; i++) {
                int hk = h / (HQ / HKV);
                int last = i + SK - SQ; /* the last key query i sees */
                double s[SK], m = -INFINITY, sum = 0.0;
                for (int j = 0; j <= last; j++) {
                    double dot = 0.0;
                    for (int d = 0; d < D; d++)
                        dot += (double)q[at(tq, b, i, h, d)] * k[at(tk, b, j, hk, d)];
                    s[j] = dot * scale;
                    if (s[j] > m) m = s[j];
                }
                for (int j = 0; j <= last; j++) sum += exp(s[j] - m);
                double *row = &o[((size_t)(b * SQ + i) * HQ + h) * D];
                for (int d = 0; d < D; d++) {
                    double acc = 0.0;
                    for (int j = 0; j <= last; j++)
                        acc += exp(s[j] - m) / sum * v[at(tk, b, j, hk, d)];
                    row[d] = acc;
                }
                lse[(b * HQ + h) * SQ + i] = m + log(sum);
            }
}

/* Naive backward in double: the gradients of L = sum(dO .* O) for the problem of naive()
   (dO laid out as O, BSHD; each gradient as its input; dK/dV summed over each GQA group). */
static void naive_backward(const float *q, const float *k, const float *v, const float *d_o,
                           const FaTensor *tq, const FaTensor *tk, double *dq, double *dk,
                           double *dv) {
    double scale = 1.0 / sqrt((double)D);
    memset(dq, 0, sizeof(double) * BATCH * SQ * HQ * D);
    memset(dk, 0, sizeof(double) * BATCH * SK * HKV * D);
    memset(dv, 0, sizeof(double) * BATCH * SK * HKV * D);
    for (int b = 0; b < BATCH; b++)
        for (int h = 0; h < HQ; h++)
            for (int i = 0; i < SQ; i++) {
                int hk = h / (HQ / HKV);
                int last = i + SK - SQ;
                double p[SK], m = -INFINITY, sum = 0.0, o_row[D], dot_o = 0.0;
                for (int j = 0; j <= last; j++) {
                    double dot = 0.0;
                    for (int d = 0; d < D; d++)
                        dot += (double)q[at(tq, b, i, h, d)] * k[at(tk, b, j, hk, d)];
                    p[j] = dot * scale;
                    if (p[j] > m) m = p[j];
                }
                for (int j = 0; j <= last; j++) sum += exp(p[j] - m);
                for (int j = 0; j <= last; j++) p[j] = exp(p[j] - m) / sum;
                const float *g = &d_o[((size_t)(b * SQ + i) * HQ + h) * D];
                for (int d = 0; d < D; d++) {
                    o_row[d] = 0.0;
                    for (int j = 0; j <= last; j++) o_row[d] += p[j] * v[at(tk, b, j, hk, d)];
                    dot_o += g[d] * o_row[d];
                }
                for (int j = 0; j <= last; j++) {
                    double dp = 0.0;
                    for (int d = 0; d < D; d++) dp += g[d] * v[at(tk, b, j, hk, d)];
                    double ds = p[j] * (dp - dot_o) * scale;
                    for (int d = 0; d < D; d++) {
                        dq[at(tq, b, i, h, d)] += ds * k[at(tk, b, j, hk, d)];
                        dk[at(tk, b, j, hk, d)] += ds * q[at(tq, b, i, h, d)];
                        dv[at(tk, b, j, hk, d)] += p[j] * g[d];
                    }
                }
            }
}

static double normwise(const double *ref, const float *got, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double e = got[i] - ref[i];
        num += e * e;
        den += ref[i] * ref[i];
    }
    return sqrt(num / den);
}

static double max_abs(const double *ref, const float *got, size_t n) {
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs(got[i] - ref[i]);
        if (!(e <= worst)) worst = e; /* NaN counts as worst */
    }
    return worst;
}

int main(void) {
    printf("flash-attention-rs %s, C API %u\n", fa_version(), fa_api_version());
    check(fa_api_version() == FA_API_VERSION, "the library implements this header's API");

    const size_t nq = (size_t)BATCH * SQ * HQ * D, nk = (size_t)BATCH * SK * HKV * D;
    const size_t nlse = (size_t)BATCH * HQ * SQ;
    float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4), *o = malloc(nq * 4);
    float *lse = malloc(nlse * 4);
    double *ref = malloc(nq * 8), *ref_lse = malloc(nlse * 8);
    uint16_t *qb = malloc(nq * 2), *kb = malloc(nk * 2), *vb = malloc(nk * 2), *ob = malloc(nq * 2);
    float *tmp = malloc(nq * 4);
    if (!q || !k || !v || !o || !lse || !ref || !ref_lse || !qb || !kb || !vb || !ob || !tmp) {
        fprintf(stderr, "out of memory\n");
        return 2;
    }

    FaProblem problem;
    memset(&problem, 0, sizeof problem);
    problem.batch = BATCH;
    problem.seqlen_q = SQ;
    problem.seqlen_k = SK;
    problem.heads_q = HQ;
    problem.heads_kv = HKV;
    problem.head_dim = D;
    problem.seqlens = FA_SEQLENS_FIXED;
    problem.causal = 1;
    problem.window_left = -1;
    problem.window_right = -1;

    /* Q is stored BHSD (a transposed view, through strides); K, V and O are BSHD. */
    FaTensor tq = {q, FA_DTYPE_F32, HQ * SQ * D, D, SQ * D};
    FaTensor tk = {k, FA_DTYPE_F32, SK * HKV * D, HKV * D, D};
    FaTensor tv = {v, FA_DTYPE_F32, SK * HKV * D, HKV * D, D};
    FaTensor to = {o, FA_DTYPE_F32, SQ * HQ * D, HQ * D, D};
    for (size_t i = 0; i < nq; i++) q[i] = uniform();
    for (size_t i = 0; i < nk; i++) k[i] = uniform();
    for (size_t i = 0; i < nk; i++) v[i] = uniform();

    /* f32 in, f32 out. */
    FaOptions opts = FA_OPTIONS_INIT;
    opts.threads = 1; /* at most the machine's cores; 0 = one per core */
    int rc = fa_forward_cpu(&problem, &tq, &tk, &tv, &to, lse, &opts);
    if (rc != FA_OK) printf("error %d: %s\n", rc, fa_last_error_message());
    check(rc == FA_OK, "f32 forward returns FA_OK");
    naive(q, k, v, &tq, &tk, ref, ref_lse);
    double err = normwise(ref, o, nq), lse_err = max_abs(ref_lse, lse, nlse);
    printf("      f32: normwise error %.3g (bound 1e-5), LSE max error %.3g (bound 1e-4)\n", err,
           lse_err);
    check(err <= 1e-5, "f32 output matches the naive attention");
    check(lse_err <= 1e-4, "f32 LSE matches");

    /* The backward (API version 6): dQ, dK, dV of L = sum(dO .* O), laid out as Q, K, V (Q's
       BHSD strides included), dO as O; the forward's LSE is required. */
    {
        float *d_o = malloc(nq * 4), *dq = malloc(nq * 4), *dk = malloc(nk * 4), *dv = malloc(nk * 4);
        double *rdq = malloc(nq * 8), *rdk = malloc(nk * 8), *rdv = malloc(nk * 8);
        if (!d_o || !dq || !dk || !dv || !rdq || !rdk || !rdv) {
            fprintf(stderr, "out of memory\n");
            return 2;
        }
        for (size_t i = 0; i < nq; i++) d_o[i] = uniform();
        FaTensor tdo = to, tdq = tq, tdk = tk, tdv = tv;
        tdo.data = d_o, tdq.data = dq, tdk.data = dk, tdv.data = dv;
        rc = fa_backward_cpu(&problem, &tq, &tk, &tv, &to, lse, &tdo, &tdq, &tdk, &tdv, &opts);
        if (rc != FA_OK) printf("error %d: %s\n", rc, fa_last_error_message());
        check(rc == FA_OK, "f32 backward returns FA_OK");
        naive_backward(q, k, v, d_o, &tq, &tk, rdq, rdk, rdv);
        double eq = normwise(rdq, dq, nq), ek = normwise(rdk, dk, nk), ev = normwise(rdv, dv, nk);
        printf("      backward: normwise errors dQ %.3g, dK %.3g, dV %.3g (bound 1e-5)\n", eq, ek, ev);
        check(eq <= 1e-5 && ek <= 1e-5 && ev <= 1e-5, "f32 gradients match the naive backward");
        /* Without the LSE: refused, the gradients untouched. */
        for (size_t i = 0; i < nq; i++) dq[i] = 7.0f;
        rc = fa_backward_cpu(&problem, &tq, &tk, &tv, &to, NULL, &tdo, &tdq, &tdk, &tdv, NULL);
        printf("      backward without lse: code %d, message \"%s\"\n", rc, fa_last_error_message());
        check(rc == FA_ERR_INVALID_ARGUMENT, "a null lse is FA_ERR_INVALID_ARGUMENT");
        int kept = 1;
        for (size_t i = 0; i < nq; i++) kept &= dq[i] == 7.0f;
        check(kept, "the gradients are untouched");
        free(d_o), free(dq), free(dk), free(dv), free(rdq), free(rdk), free(rdv);
    }

    /* bf16 in, bf16 out: the reference sees the same rounded inputs. */
    for (size_t i = 0; i < nq; i++) q[i] = from_bf16(qb[i] = to_bf16(q[i]));
    for (size_t i = 0; i < nk; i++) k[i] = from_bf16(kb[i] = to_bf16(k[i]));
    for (size_t i = 0; i < nk; i++) v[i] = from_bf16(vb[i] = to_bf16(v[i]));
    FaTensor bq = tq, bk = tk, bv = tv, bo = to;
    bq.data = qb, bk.data = kb, bv.data = vb, bo.data = ob;
    bq.dtype = bk.dtype = bv.dtype = bo.dtype = FA_DTYPE_BF16;
    rc = fa_forward_cpu(&problem, &bq, &bk, &bv, &bo, lse, NULL);
    if (rc != FA_OK) printf("error %d: %s\n", rc, fa_last_error_message());
    check(rc == FA_OK, "bf16 forward returns FA_OK");
    naive(q, k, v, &tq, &tk, ref, ref_lse);
    for (size_t i = 0; i < nq; i++) tmp[i] = from_bf16(ob[i]);
    err = normwise(ref, tmp, nq);
    lse_err = max_abs(ref_lse, lse, nlse);
    printf("      bf16: normwise error %.3g (bound 1e-2), LSE max error %.3g (bound 1e-4)\n", err,
           lse_err);
    check(err <= 1e-2, "bf16 output matches the naive attention");
    check(lse_err <= 1e-4, "bf16 LSE matches");

    /* Bad input: a null Q pointer is refused with a code and a message; O is untouched. */
    for (size_t i = 0; i < nq; i++) o[i] = 7.0f;
    tq.data = NULL;
    tq.dtype = FA_DTYPE_F32;
    rc = fa_forward_cpu(&problem, &tq, &tk, &tv, &to, NULL, NULL);
    const char *msg = fa_last_error_message();
    printf("      bad call: code %d, message \"%s\"\n", rc, msg);
    check(rc == FA_ERR_INVALID_ARGUMENT, "a null q is FA_ERR_INVALID_ARGUMENT");
    check(msg != NULL && strstr(msg, "q is a null pointer") != NULL, "the message names q");
    int untouched = 1;
    for (size_t i = 0; i < nq; i++) untouched &= o[i] == 7.0f;
    check(untouched, "the output is untouched");

    /* An options struct from a newer header (larger size) is refused cleanly. */
    tq.data = q;
    opts.size = sizeof(FaOptions) + 8;
    rc = fa_forward_cpu(&problem, &tq, &tk, &tv, &to, NULL, &opts);
    check(rc == FA_ERR_VERSION, "options of a newer size are FA_ERR_VERSION");

    /* K/V as a padded KV cache of capacity SK, every sequence using all its keys: the same
       attention (f32 inputs again; the reference of the rounded inputs still holds). */
    int32_t seqused_k[BATCH] = {SK, SK};
    FaKvCache cache = FA_KV_CACHE_INIT;
    cache.seqused_k = seqused_k;
    rc = fa_forward_cache_cpu(&problem, &cache, &tq, &tk, &tv, &to, lse, NULL);
    if (rc != FA_OK) printf("error %d: %s\n", rc, fa_last_error_message());
    check(rc == FA_OK, "cache forward returns FA_OK");
    err = normwise(ref, o, nq);
    printf("      cache: normwise error %.3g (bound 1e-5)\n", err);
    check(err <= 1e-5, "cache output matches the naive attention");
    for (size_t i = 0; i < nq; i++) o[i] = 7.0f;
    seqused_k[1] = SK + 1;
    rc = fa_forward_cache_cpu(&problem, &cache, &tq, &tk, &tv, &to, lse, NULL);
    printf("      bad cache: code %d, message \"%s\"\n", rc, fa_last_error_message());
    check(rc == FA_ERR_INVALID_ARGUMENT, "a length past the cache is FA_ERR_INVALID_ARGUMENT");
    untouched = 1;
    for (size_t i = 0; i < nq; i++) untouched &= o[i] == 7.0f;
    check(untouched, "the output is untouched");

    /* A paged cache's block walk (for fa_forward_cache_cuda's FaKvCache.block_walk, after a
       copy to the device), built on the host: 2 sequences of up to 3 blocks of 4 keys in a
       pool of 6 blocks. Sequence 0 uses 9 keys (blocks 4, 0, 5: all three), sequence 1 uses
       4 (block 2); per sequence the used blocks by physical index, then their logical
       indices, zeros after; the entry past the walk stays as it was. */
    {
        int32_t used[2] = {9, 4};
        const int32_t table[6] = {4, 0, 5, 2, -1, -1};
        const int32_t want[12] = {0, 4, 5, 1, 0, 2, /* sequence 1 */ 2, 0, 0, 0, 0, 0};
        int32_t walk[13];
        for (int i = 0; i < 13; i++) walk[i] = -7;
        rc = fa_block_walk(used, table, 2, 3, 4, 6, walk, 13);
        if (rc != FA_OK) printf("error %d: %s\n", rc, fa_last_error_message());
        check(rc == FA_OK, "fa_block_walk returns FA_OK");
        int same = walk[12] == -7;
        for (int i = 0; i < 12; i++) same &= walk[i] == want[i];
        check(same, "the walk sorts each sequence's used blocks by physical index");
        for (int i = 0; i < 13; i++) walk[i] = -7;
        used[1] = 13; /* past the 3 blocks of 4 keys */
        rc = fa_block_walk(used, table, 2, 3, 4, 6, walk, 13);
        printf("      bad walk: code %d, message \"%s\"\n", rc, fa_last_error_message());
        check(rc == FA_ERR_INVALID_ARGUMENT, "a length past the cache is FA_ERR_INVALID_ARGUMENT");
        untouched = 1;
        for (int i = 0; i < 13; i++) untouched &= walk[i] == -7;
        check(untouched, "the walk is untouched");
        /* The padded cache above has no blocks to walk; the CPU never takes a walk. */
        seqused_k[1] = SK;
        cache.block_walk = walk;
        for (size_t i = 0; i < nq; i++) o[i] = 7.0f;
        rc = fa_forward_cache_cpu(&problem, &cache, &tq, &tk, &tv, &to, lse, NULL);
        printf("      walk on the CPU: code %d, message \"%s\"\n", rc, fa_last_error_message());
        check(rc == FA_ERR_INVALID_ARGUMENT, "a walk on fa_forward_cache_cpu is FA_ERR_INVALID_ARGUMENT");
        untouched = 1;
        for (size_t i = 0; i < nq; i++) untouched &= o[i] == 7.0f;
        check(untouched, "the output is untouched");
    }

    free(q), free(k), free(v), free(o), free(lse), free(ref), free(ref_lse);
    free(qb), free(kb), free(vb), free(ob), free(tmp);
    if (failures) {
        printf("%d check(s) failed\n", failures);
        return 1;
    }
    printf("all checks passed\n");
    return 0;
}
