// <cublasLt.h> for its types and prototypes only (libcublasLt is loaded at run time, never linked),
// without parsing <cuda_fp16.h> and <cuda_bf16.h>: 63 MB of g++'s memory in every TU that includes
// kiln (benchmarks/RESULTS.md, compile time). cuBLAS's prototypes name __half and __nv_bfloat16
// only through pointers, so their declarations suffice. A TU that included either header before
// kiln is left as it is; one that includes them after kiln parses them in full as usual.
#pragma once
#if !defined(__CUDA_FP16_H__) && !defined(__CUDA_BF16_H__)
struct __half;
struct __nv_bfloat16;
#define __CUDA_FP16_H__
#define __CUDA_BF16_H__
#include <cublasLt.h>
#undef __CUDA_FP16_H__
#undef __CUDA_BF16_H__
#else
#include <cublasLt.h>
#endif
