// PTX helpers shared by the kernel families: integer types, shared-memory addresses, cp.async,
// ldmatrix, mma.sync (m16n8k16, f32 accumulation), 16-bit packing, warp shuffles and votes.
// No toolkit header is included: every instruction is inline PTX. Needs sm_80 or newer.
#ifndef FA_COMMON_PTX_CUH
#define FA_COMMON_PTX_CUH

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
struct alignas(16) u32x4 { u32 x, y, z, w; };

static __device__ __forceinline__ u32 smem_u32(const void* ptr) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(ptr));
    return r;
}

static __device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool pred) {
    const int n = pred ? 16 : 0; // 0 bytes read: the 16 destination bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
// 4-byte cp.async (through L1: the 16-byte-only .cg form does not take 4), zero-filling the
// destination when `pred` is false.
static __device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool pred) {
    const int n = pred ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}

static __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
static __device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

static __device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr) : "memory");
}
static __device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr) : "memory");
}

// D += A * B, m16n8k16, f32 accumulators; BF16 picks bf16 or fp16 operands.
template <bool BF16>
static __device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
    if constexpr (BF16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Two f32 to a packed 16-bit pair (round to nearest even); `lo` lands in the low half.
template <bool BF16>
static __device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    if constexpr (BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

static __device__ __forceinline__ float shfl_xor(float x, int mask) {
    float y;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(y) : "f"(x), "r"(mask));
    return y;
}
static __device__ __forceinline__ bool warp_any(bool x) {
    u32 r;
    asm volatile("{ .reg .pred p, q; setp.ne.u32 p, %1, 0; vote.sync.any.pred q, p, 0xffffffff; selp.u32 %0, 1, 0, q; }"
                 : "=r"(r) : "r"((u32)x));
    return r != 0;
}

#endif // FA_COMMON_PTX_CUH
