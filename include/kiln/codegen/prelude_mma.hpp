// The tensor-core tile primitives of sm_80 and later (cp.async, ldmatrix, mma.sync, packing), for
// the kernels that stage tiles in shared memory and multiply them: the attention kernels
// (attention_prelude.hpp) and the block programs' `dot` (prelude_dot.hpp). Device code only.
#pragma once
#include <string_view>

namespace kiln::codegen {

inline constexpr std::string_view prelude_mma = R"KILN(typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// ---- tile primitives -------------------------------------------------------------------------------
__device__ __forceinline__ u32 kiln_shared_address(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
// 16 bytes global -> shared, asynchronously; bytes < 16 fills the rest with zeros.
__device__ __forceinline__ void kiln_cp_async16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(kiln_shared_address(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void kiln_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void kiln_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
// Four 8x8 16-bit matrices from shared memory: lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void kiln_ldmatrix_x4(u32 (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(kiln_shared_address(row)));
}
__device__ __forceinline__ void kiln_ldmatrix_x4_trans(u32 (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(kiln_shared_address(row)));
}
// d += a b for a 16x16 tile a (row major), a 16x8 tile b (column major), f32 d.
__device__ __forceinline__ void kiln_mma_16816_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void kiln_mma_16816_f16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two f32 values as one word of two 16-bit values, x0 in the low half (the lower address).
__device__ __forceinline__ u32 kiln_pack_bf16(float x0, float x1) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %2, %1;\n" : "=r"(r) : "f"(x0), "f"(x1));
  return r;
}
__device__ __forceinline__ u32 kiln_pack_f16(float x0, float x1) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %2, %1;\n" : "=r"(r) : "f"(x0), "f"(x1));
  return r;
}
)KILN";

}  // namespace kiln::codegen
