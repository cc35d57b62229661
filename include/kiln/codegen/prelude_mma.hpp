// The tensor-core tile primitives of sm_80 and later (cp.async, ldmatrix, mma.sync, packing), for
// the kernels that stage tiles in shared memory and multiply them: the attention kernels
// (attention_prelude.hpp) and the block programs' `dot` (prelude_dot.hpp). Device code only.
// prelude_wgmma and wgmma_function: Hopper's warpgroup MMA (sm_90a), after prelude_mma and a u64.
#pragma once
#include <string>
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

// wgmma's shared-memory descriptors, fences, commits and waits.
inline constexpr std::string_view prelude_wgmma =
    R"KILN(// ---- warpgroup MMA -----------------------------------------------------------------------------------
// A shared-memory matrix descriptor: start address, leading and stride byte offsets (16-byte units),
// 128-byte swizzle (layout type 1, bits 62-63).
__device__ __forceinline__ u64 kiln_wgmma_desc(u32 address, u32 leading, u32 stride) {
  return (u64)((address & 0x3FFFF) >> 4) | ((u64)(leading >> 4) << 16) | ((u64)(stride >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void kiln_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void kiln_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>  // until at most N groups of this warpgroup's MMAs are pending
__device__ __forceinline__ void kiln_wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// What cp.async wrote (the generic proxy) becomes visible to wgmma's reads (the async proxy).
__device__ __forceinline__ void kiln_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accumulators across an asynchronous MMA's issue and wait.
template <int N>
__device__ __forceinline__ void kiln_hold(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
)KILN";

// A wgmma m64nNk16 with f32 accumulators d[N/2] (the warpgroup's 64 x N tile), B from a shared-memory
// descriptor, A from one (`a_registers` false) or from four registers a thread. `first`: d = a b
// (its outputs are written, not read), else d += a b. trans_b: B is MN-major (v, read transposed);
// trans_a: A (from shared memory) is MN-major.
inline std::string wgmma_function(const std::string& name, int n, bool a_registers, bool first, int trans_b,
                                  const std::string& type, int trans_a = 0) {
  const int regs = n / 2;
  std::string operands, outs;
  for (int i = 0; i < regs; ++i) {
    operands += (i ? ", %" : "%") + std::to_string(i);
    outs += std::string(i ? ", " : "") + (first ? "\"=f\"(d[" : "\"+f\"(d[") + std::to_string(i) + "])";
  }
  int next = regs;
  std::string a_operand, ins;
  if (a_registers) {
    a_operand = "{%" + std::to_string(next) + ", %" + std::to_string(next + 1) + ", %" + std::to_string(next + 2) +
                ", %" + std::to_string(next + 3) + "}";
    next += 4;
    ins = "\"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), ";
  } else {
    a_operand = "%" + std::to_string(next++);
    ins = "\"l\"(a), ";
  }
  const std::string b_operand = "%" + std::to_string(next++);
  ins += "\"l\"(b)";
  const std::string tail = a_registers ? ", 1, 1, " + std::to_string(trans_b)
                                       : ", 1, 1, " + std::to_string(trans_a) + ", " + std::to_string(trans_b);
  std::string s = "__device__ __forceinline__ void " + name + "(float (&d)[" + std::to_string(regs) + "], " +
                  (a_registers ? "const u32 (&a)[4]" : "u64 a") + ", u64 b) {\n";
  s += "  asm volatile(\"{\\n.reg .pred p;\\nsetp.ne.b32 p, " + std::string(first ? "0" : "1") +
       ", 0;\\nwgmma.mma_async.sync.aligned.m64n" + std::to_string(n) + "k16.f32." + type + "." + type + " {" +
       operands + "}, " + a_operand + ", " + b_operand + ", p" + tail + ";\\n}\\n\"\n";
  s += "               : " + outs + "\n               : " + ins + ");\n}\n";
  return s;
}

}  // namespace kiln::codegen
