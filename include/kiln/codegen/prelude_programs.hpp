// The prelude's loop macros (prelude.hpp), after prelude_memory.hpp's loads, stores and row
// reductions: how a kernel's programs, rows and tiles map onto the GPU's grid or the CPU's
// programs.
#pragma once
#include <string_view>

namespace kiln::codegen {

inline constexpr std::string_view prelude_programs =
    R"KILN(// ---- programs: how a kernel's loops map onto the target -------------------------------------
// Each kernel defines XBLOCK/XVEC (pointwise) or ROWS/ROW_THREADS/RVEC (rows) before its loops, and
// `ix`, the type of its index arithmetic (int where every index it forms fits in 32 bits, else i64:
// codegen/kernel_writer_impl.hpp's narrow_indices).
#ifdef KILN_DEVICE_CODE
#define KILN_POINTWISE_LOOP(xoffset)                                                      \
  KILN_UNROLL for (int kiln_u = 0; kiln_u < XBLOCK / (THREADS * XVEC); ++kiln_u)          \
    if (const ix xoffset = (ix)blockIdx.x * XBLOCK + ((ix)kiln_u * THREADS + threadIdx.x) * XVEC; true)
// Programs loop over rows (a grid smaller than the row count): in blocks of several rows, loads
// that do not depend on the row (weights, biases) are made once per thread, before the loop.
#define KILN_HOST_ROWS_IN(test) (test)  // a host row program's rows, on a GPU's grid: tested
#define KILN_ROW(xindex)                                                                  \
  for (ix kiln_xbase = (ix)blockIdx.x * ROWS; kiln_xbase < xnumel; kiln_xbase += (ix)gridDim.x * ROWS) \
    if (const ix xindex = kiln_xbase + threadIdx.x / ROW_THREADS; true)
// The row group whose column partial sums this block keeps (schedule/partials.hpp): a block a
// group, its row slots folding their sums into the first slot's at the end (fold_row_slots); the
// launch has exactly as many blocks as groups over the rows.
#define KILN_ROW_GROUP ((ix)blockIdx.x)
// Whether this thread is in the block's first row slot (the one that stores a group's partials).
#define KILN_FIRST_ROW_SLOT (threadIdx.x < ROW_THREADS)
// Looped rows: RUNROLL steps at a time (launch_config.hpp), to keep several loads in flight.
#define KILN_R_LOOP(roffset, rnumel)                                                      \
  _Pragma("unroll (RUNROLL)") for (ix roffset = (ix)(threadIdx.x % ROW_THREADS) * RVEC; roffset < (rnumel); roffset += (ix)ROW_THREADS * RVEC)
#define KILN_R_TILES(roffset)                                                             \
  KILN_UNROLL for (int kiln_it = 0; kiln_it < RITERS; ++kiln_it)                          \
    if (const ix roffset = ((ix)kiln_it * ROW_THREADS + threadIdx.x % ROW_THREADS) * RVEC; true)
// Rows of a length no whole number of vectors: the tiles start `shift` elements before the row, on
// the vector that holds its first element (rows of 50257 bf16 values start anywhere in a vector;
// tiles from the row's start made every access element by element). Lanes before the row are
// masked by the kernel (rindex >= 0).
#define KILN_R_TILES_SHIFTED(roffset, shift)                                              \
  KILN_UNROLL for (int kiln_it = 0; kiln_it < RITERS; ++kiln_it)                          \
    if (const ix roffset = ((ix)kiln_it * ROW_THREADS + threadIdx.x % ROW_THREADS) * RVEC - (shift); true)
#define KILN_R_LOOP_SHIFTED(roffset, rnumel, shift)                                       \
  _Pragma("unroll (RUNROLL)") for (ix roffset = (ix)(threadIdx.x % ROW_THREADS) * RVEC - (shift); roffset < (rnumel); roffset += (ix)ROW_THREADS * RVEC)
// Rows split at their last whole vector (codegen's write_rows: host rows, GPU rows of symbolic
// length): the whole vectors as above, the vector with the row's end by the first thread of the row.
#define KILN_R_LOOP_FULL(roffset, rnumel)                                                 \
  _Pragma("unroll (RUNROLL)") for (ix roffset = (ix)(threadIdx.x % ROW_THREADS) * RVEC; roffset + RVEC <= (rnumel); roffset += (ix)ROW_THREADS * RVEC)
#define KILN_R_LOOP_TAIL(roffset, rnumel)                                                 \
  for (ix roffset = (rnumel) - (rnumel) % RVEC; threadIdx.x % ROW_THREADS == 0 && roffset < (rnumel); roffset += RVEC)
#define KILN_R_TILES_FULL(roffset)                                                        \
  KILN_UNROLL for (int kiln_it = 0; kiln_it < RITERS; ++kiln_it)                          \
    if (const ix roffset = ((ix)kiln_it * ROW_THREADS + threadIdx.x % ROW_THREADS) * RVEC; roffset + RVEC <= rnumel)
#define KILN_R_TILES_TAIL(roffset)                                                        \
  KILN_UNROLL for (int kiln_it = 0; kiln_it < RITERS; ++kiln_it)                          \
    if (const ix roffset = ((ix)kiln_it * ROW_THREADS + threadIdx.x % ROW_THREADS) * RVEC; roffset < rnumel && roffset + RVEC > rnumel)
// The host's program shapes, given a meaning on the device too (one source, two targets: a host
// kernel's source compiles with NVRTC and runs correctly on any grid, without being tuned for it).
#define KILN_COLUMN_TILES(xrow, xcoff, xrows, XROWS, COLS)                                          \
  for (ix xrow = (ix)blockIdx.x * (XROWS); xrow < (ix)(blockIdx.x + 1) * (XROWS) && xrow < (xrows); ++xrow) \
    for (ix xcoff = (ix)threadIdx.x * XVEC; xcoff < (COLS); xcoff += (ix)blockDim.x * XVEC)
#define KILN_COLUMN_ROWS(xrow, xrows, XROWS) \
  for (ix xrow = (ix)blockIdx.x * (XROWS); xrow < (ix)(blockIdx.x + 1) * (XROWS) && xrow < (xrows); ++xrow)
#define KILN_COLUMNS_FULL(xcoff, COLS) \
  for (ix xcoff = (ix)threadIdx.x * XVEC; xcoff + XVEC <= (COLS); xcoff += (ix)blockDim.x * XVEC)
#define KILN_COLUMNS_TAIL(xcoff, COLS) \
  for (ix xcoff = (COLS) - (COLS) % XVEC; threadIdx.x == 0 && xcoff < (COLS); xcoff += XVEC)
#define KILN_COLUMN_PROGRAM(xoffset)                                                      \
  for (ix xoffset = ((ix)blockIdx.x * blockDim.x + threadIdx.x) * XVEC; xoffset < xnumel; \
       xoffset += (ix)gridDim.x * blockDim.x * XVEC)
// GPU column blocks (launch_config.hpp): a block covers XT * XVEC kept elements, looping over such
// groups (the same number of times in every thread: across_columns' barriers), and its RT threads
// of each column take every RT-th reduced element.
#define KILN_COLUMN_BLOCK(xoffset)                                                                   \
  for (ix kiln_xblock = blockIdx.x; kiln_xblock * (XT * XVEC) < xnumel; kiln_xblock += gridDim.x) \
    if (const ix xoffset = (kiln_xblock * XT + (ix)(threadIdx.x % XT)) * XVEC; true)
#define KILN_R_COLUMN_STEPS(rindex) \
  _Pragma("unroll (RUNROLL)") for (ix rindex = (ix)(threadIdx.x / XT); rindex < rnumel; rindex += RT)
// ... and columns held in registers (RITERS steps a thread, the last ones past the column skipped):
// kiln_it indexes a thread's register tiles, as KILN_R_TILES' does a row's.
#define KILN_R_COLUMN_TILES(rindex)                                   \
  KILN_UNROLL for (int kiln_it = 0; kiln_it < RITERS; ++kiln_it)      \
    if (const ix rindex = (ix)(threadIdx.x / XT) + (ix)kiln_it * RT; rindex < rnumel)
#else
#define KILN_POINTWISE_LOOP(xoffset)                                   \
  for (int kiln_u = 0; kiln_u < XBLOCK / XVEC; ++kiln_u)              \
    if (const ix xoffset = kiln_pid * XBLOCK + (ix)kiln_u * XVEC; true)
// Host pointwise kernels with a broadcast operand (codegen/kernel_writer_columns.hpp): a program's
// whole rows, each as column tiles.
#define KILN_COLUMN_TILES(xrow, xcoff, xrows, XROWS, COLS)                                          \
  for (ix xrow = kiln_pid * (XROWS); xrow < (kiln_pid + 1) * (XROWS) && xrow < (xrows); ++xrow) \
    for (ix xcoff = 0; xcoff < (COLS); xcoff += XVEC)
// ... and rows of a length no whole number of tiles: the whole tiles, then the one with the row's end.
#define KILN_COLUMN_ROWS(xrow, xrows, XROWS) \
  for (ix xrow = kiln_pid * (XROWS); xrow < (kiln_pid + 1) * (XROWS) && xrow < (xrows); ++xrow)
#define KILN_COLUMNS_FULL(xcoff, COLS) for (ix xcoff = 0; xcoff + XVEC <= (COLS); xcoff += XVEC)
#define KILN_COLUMNS_TAIL(xcoff, COLS) for (ix xcoff = (COLS) - (COLS) % XVEC; xcoff < (COLS); xcoff += XVEC)
// Host row kernels: a program's ROWS rows, the last program's stopping at xnumel (its rows past the
// end would only be masked, and a dynamic kernel's ROWS, sized for rows of unknown length, may be far
// more than a call has: 64 masked rows made a dynamic layer_norm over 2 rows take 6x its static
// kernel, NOTES item 97).
#define KILN_HOST_ROWS_IN(test) true  // KILN_ROW below stops at xnumel
#define KILN_ROW(xindex) \
  for (ix xindex = kiln_pid * ROWS; xindex < (kiln_pid + 1) * ROWS && xindex < xnumel; ++xindex)
// Host reductions over outer dims (launch_config.hpp's x_lanes): a program's XVEC kept elements are
// one tile's lanes, and each step of the reduced elements is a scalar rindex.
#define KILN_COLUMN_PROGRAM(xoffset) if (const ix xoffset = kiln_pid * XVEC; true)
#define KILN_ROW_GROUP kiln_pid
#define KILN_R_LOOP(roffset, rnumel) for (ix roffset = 0; roffset < (rnumel); roffset += RVEC)
#define KILN_R_TILES(roffset) \
  for (int kiln_it = 0; kiln_it < RITERS; ++kiln_it) if (const ix roffset = (ix)kiln_it * RVEC; true)
// A row of a length no whole number of vectors (codegen's write_rows): its whole vectors, unmasked,
// then the vector that holds its end (none past it: their lanes would all be masked).
#define KILN_R_LOOP_FULL(roffset, rnumel) for (ix roffset = 0; roffset + RVEC <= (rnumel); roffset += RVEC)
#define KILN_R_LOOP_TAIL(roffset, rnumel) \
  for (ix roffset = (rnumel) - (rnumel) % RVEC; roffset < (rnumel); roffset += RVEC)
#define KILN_R_TILES_FULL(roffset)                                                                  \
  for (int kiln_it = 0, kiln_whole = (int)(rnumel / RVEC < RITERS ? rnumel / RVEC : RITERS); kiln_it < kiln_whole; ++kiln_it) \
    if (const ix roffset = (ix)kiln_it * RVEC; true)
#define KILN_R_TILES_TAIL(roffset)                                                                  \
  for (int kiln_it = (int)(rnumel / RVEC); kiln_it < RITERS && (ix)kiln_it * RVEC < rnumel; ++kiln_it) \
    if (const ix roffset = (ix)kiln_it * RVEC; true)
#endif
#ifdef KILN_DEVICE_CODE
#define KILN_R_STEPS(rindex) _Pragma("unroll (RUNROLL)") for (ix rindex = 0; rindex < rnumel; ++rindex)
#else
#define KILN_R_STEPS(rindex) for (ix rindex = 0; rindex < rnumel; ++rindex)
#endif
)KILN";

}  // namespace kiln::codegen
