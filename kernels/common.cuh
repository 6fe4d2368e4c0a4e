// Shared by every kernel family (the loader prepends it): integer names, f16 <-> f32.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// RoPE of the pair (x0, x1) by the angle of cosine c, sine s: each product and each sum rounded
// on its own (no FMA contraction), as the numpy reference computes it, so that every kernel
// that rotates (rope.cu, rope_kv, attn_decode) gives the same bits.
__device__ __forceinline__ float2 rope_rot(float x0, float x1, float c, float s) {
    return make_float2(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)), __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
}

// Two floats as an f16 pair (lo in the low half), and the f16 tensor-core multiply
// D = A·B + D (m16n8k16, f32 accumulators; fragment layouts in attention.cu's attn_chunk).
__device__ __forceinline__ u32 pack_h2(float lo, float hi) { return (u32)f2h(lo) | ((u32)f2h(hi) << 16); }
__device__ __forceinline__ void mma_f16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Programmatic dependent launch (sm_90). Launched with the PDL attribute (backends/cuda.py does
// so inside the captured decode step), a kernel may start while the previous kernel on its
// stream is still finishing. Every kernel lets its successor launch at once (pdl_launch_next)
// and waits for its predecessor's completion and writes (pdl_wait) before it touches global
// memory that kernels write; work on read-only weights may come before the wait. Launched the
// ordinary way, both are no-ops.
__device__ __forceinline__ void pdl_launch_next() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
#define PDL_ENTRY \
    pdl_launch_next(); \
    pdl_wait();

// Start pulling `bytes` at p into L2 (the warp's lanes take 128-byte lines in turn).
__device__ __forceinline__ void prefetch_l2(const void* p, long long bytes) {
    for (long long o = (long long)(threadIdx.x & 31) * 128; o < bytes; o += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"((const char*)p + o));
}
