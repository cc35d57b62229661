// The second half of the prelude (prelude.hpp): how tiles move between memory and registers
// (contiguous and gathered loads and stores, the 16-byte load paths) and row reductions across
// threads; prelude_programs.hpp has the loop macros that follow them.
#pragma once
#include <string_view>

namespace kiln::codegen {

inline constexpr std::string_view prelude_memory =
    R"KILN(// ---- loads and stores -----------------------------------------------------------------------
// A gather: each lane reads p[idx]; masked lanes give `other` and touch no memory.
template <class T, class I, class M>
KILN_FN auto load(const T* p, const I& idx, const M& mask, typename compute_of<T>::type other = 0) {
  typedef typename compute_of<T>::type C;
  constexpr int N = width_of<I, M>::value;
  if constexpr (N == 0) {
    return mask ? to_compute(p[idx]) : other;
  } else {
    tile<C, N> r;
KILN_UNROLL
    for (int i = 0; i < N; ++i) r.v[i] = lane(mask, i) ? to_compute(p[lane(idx, i)]) : other;
    return r;
  }
}
// How a contiguous access finds out whether it may move whole 16-byte vectors: `test` at each
// access; `vector`: the kernel tested its pointers once and the tile starts on a vector; `scalar`:
// that test failed (an offset or foreign buffer), element by element with no per-access test;
// `tile` (stores): as `test`, and a tile whose lanes are all live but which starts off a vector
// moves element by element without a test a lane (16-bit rows of odd length, where most tiles
// are such; benchmarks/NOTES.md item 172).
enum class align { test, vector, scalar, tile };
template <bool B> struct bool_c { static constexpr bool value = B; };
// Whether every pointer is 16-byte aligned (kernels test this once: KILN_ALIGNED).
template <class... P> KILN_FN bool aligned16(const P*... p) {
  return (((unsigned long long)(const void*)p | ... | 0ull) & 15) == 0;
}

// How 16-byte loads reach memory: `readonly` lets the compiler take the read-only path for const
// __restrict__ inputs (LDG.CONSTANT), `plain` is a plain ld.global (what Triton emits), `streaming`
// the evict-first ld.global.cs. Kernels that evaluate special functions load `plain` (the kernel
// writer passes it; measured on an H200: W1b -2.2%, W7 -1.9%, pure streams +0.3-0.8% with it).
enum class via { readonly, plain, streaming };
#ifdef KILN_DEVICE_CODE
// One 16-byte vector load. KILN_LOADS (the KILN_TUNE_LOADS knob, for A/B runs) overrides every
// kernel's choice: 0 readonly, 1 plain, 2 streaming. The asm is volatile: without it the compiler
// took it for a pure computation and hoisted it above the alignment and mask tests that guard it
// (misaligned-address faults in the random-graph test); ptxas still schedules it as a load. It
// needs no memory clobber: kernels never store to an input element before loading it (an in-place
// update stores a value computed from that very load).
template <via W, class V> KILN_FN V load16(const V* p) {
#ifdef KILN_LOADS
  constexpr via w = static_cast<via>(KILN_LOADS);  // 0, 1, 2: the enum's order
#else
  constexpr via w = W;
#endif
  if constexpr (w == via::readonly) {
    return *p;
  } else {
    union { unsigned u[4]; V v; } r;
    if constexpr (w == via::plain)
      asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.u[0]), "=r"(r.u[1]), "=r"(r.u[2]), "=r"(r.u[3]) : "l"(p));
    else
      asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.u[0]), "=r"(r.u[1]), "=r"(r.u[2]), "=r"(r.u[3]) : "l"(p));
    return r.v;
  }
}
#endif
// N consecutive elements from p[base], each passed through `f` as it is read: one 16-byte vector
// when aligned and unmasked, else element by element (masked-off lanes get `other`). Converting as
// the vector is read matters: a raw load plus selects afterwards measured 15% slower.
template <int N, align A, via W, class T, class M, class F, class R = decltype(F()(T{}))>
KILN_FN tile<R, N> load_contig_as(const T* p, i64 base, const M& mask, F f, R other) {
  tile<R, N> r;
#ifdef KILN_DEVICE_CODE
  if constexpr ((sizeof(T) * N) % 16 == 0 && A != align::scalar) {  // whole 16-byte vectors
    constexpr int V = 16 / sizeof(T);
    bool all = true;
KILN_UNROLL
    for (int i = 0; i < N; ++i) all = all && lane(mask, i);
    if (all && (A == align::vector || ((unsigned long long)(p + base) & 15) == 0)) {
      struct alignas(16) vec { T e[V]; };
KILN_UNROLL
      for (int c = 0; c < N / V; ++c) {
        vec w = load16<W>(reinterpret_cast<const vec*>(p + base + c * V));
KILN_UNROLL
        for (int i = 0; i < V; ++i) r.v[c * V + i] = f(w.e[i]);
      }
      return r;
    }
  }
#endif
KILN_UNROLL
  for (int i = 0; i < N; ++i) r.v[i] = lane(mask, i) ? f(p[base + i]) : other;
  return r;
}
struct as_stored { template <class T> KILN_FN T operator()(T x) const { return x; } };
struct as_compute { template <class T> KILN_FN auto operator()(T x) const { return to_compute(x); } };

// N consecutive elements from p[base], unconverted (a register cache of 16-bit values keeps these
// and widens them on use).
template <int N, align A = align::test, via W = via::readonly, class T, class M>
KILN_FN tile<T, N> load_contig_raw(const T* p, i64 base, const M& mask) {
  return load_contig_as<N, A, W>(p, base, mask, as_stored(), T{});
}
template <class T, class I, class M>
KILN_FN auto load_raw(const T* p, const I& idx, const M& mask) {
  constexpr int N = width_of<I, M>::value;
  tile<T, N> r;
KILN_UNROLL
  for (int i = 0; i < N; ++i) r.v[i] = lane(mask, i) ? p[lane(idx, i)] : T{};
  return r;
}
template <class T, int N> KILN_FN auto widen(const tile<T, N>& t) {
  tile<typename compute_of<T>::type, N> r;
KILN_UNROLL
  for (int i = 0; i < N; ++i) r.v[i] = to_compute(t.v[i]);
  return r;
}

// N consecutive elements from p[base] in the compute type.
template <int N, align A = align::test, via W = via::readonly, class T, class M>
KILN_FN tile<typename compute_of<T>::type, N> load_contig(const T* p, i64 base, const M& mask,
                                                          typename compute_of<T>::type other = 0) {
  return load_contig_as<N, A, W>(p, base, mask, as_compute(), other);
}
template <class T, class I, class V, class M>
KILN_FN void store(T* p, const I& idx, const V& v, const M& mask) {
  constexpr int N = widest<I, V, M>::value;
  if constexpr (N == 0) {
    if (mask) p[idx] = store_cast<T>(v);
  } else {
KILN_UNROLL
    for (int i = 0; i < N; ++i)
      if (lane(mask, i)) p[lane(idx, i)] = store_cast<T>(lane(v, i));
  }
}
#ifdef KILN_DEVICE_CODE
// One 16- or 8-byte vector store, as 32-bit words. A vector stored through C++ (a struct of 8 bf16
// values, or a uint4 of their bits) was split by the compiler into 2- and 4-byte stores where a
// row's mask let it merge the vector path with the lane-by-lane one (layer_norm over rows of 1000
// bf16 values: 7 stores a vector, 3.5x the L2 write sectors, 38% of the copy ceiling;
// benchmarks/NOTES.md item 73). Volatile, without a memory clobber, as load16: kernels never load
// an element after storing it.
template <class T> KILN_FN void store_words(T* p, const unsigned (&u)[4]) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(u[0]), "r"(u[1]), "r"(u[2]), "r"(u[3]));
}
template <class T> KILN_FN void store_words(T* p, const unsigned (&u)[2]) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(u[0]), "r"(u[1]));
}
#endif
template <int N, align A = align::test, class T, class V, class M>
KILN_FN void store_contig(T* p, i64 base, const V& v, const M& mask) {
#ifdef KILN_DEVICE_CODE
  if constexpr (((sizeof(T) * N) % 16 == 0 || sizeof(T) * N == 8) && A != align::scalar) {
    constexpr int L = sizeof(T) * N == 8 ? N : 16 / sizeof(T);  // lanes a vector
    constexpr int B = sizeof(T) * L;  // bytes a vector
    bool all = true;
KILN_UNROLL
    for (int i = 0; i < N; ++i) all = all && lane(mask, i);
    if (all && (A == align::vector || ((unsigned long long)(p + base) & (B - 1)) == 0)) {
KILN_UNROLL
      for (int c = 0; c < N / L; ++c) {
        union { T e[L]; unsigned u[B / 4]; } w;
KILN_UNROLL
        for (int i = 0; i < L; ++i) w.e[i] = store_cast<T>(lane(v, c * L + i));
        store_words(p + base + c * L, w.u);
      }
      return;
    }
    if constexpr (A == align::tile) {
      if (all) {
KILN_UNROLL
        for (int i = 0; i < N; ++i) p[base + i] = store_cast<T>(lane(v, i));
        return;
      }
    }
  }
#endif
KILN_UNROLL
  for (int i = 0; i < N; ++i)
    if (lane(mask, i)) p[base + i] = store_cast<T>(lane(v, i));
}
// Keeps the compiler from moving memory accesses across this point: looped GPU rows keep column
// partial sums in memory, and a row's loads of them must follow the previous row's stores (which
// may be asm the compiler does not see into).
KILN_FN void memory_order_fence() { asm volatile("" ::: "memory"); }

#ifdef KILN_DEVICE_CODE
// A looped row's tile kept in shared memory for the row's later loops (codegen's kept_row_load),
// and read back: whole 16-byte words where the tile spans them (a struct copy went element by
// element), the thread's own cells only.
template <class T, int N> KILN_FN void keep_tile(tile<T, N>& cell, const tile<T, N>& t) {
  if constexpr ((sizeof(T) * N) % 16 == 0) {
    struct alignas(16) word { unsigned u[4]; };
    union { tile<T, N> t; word w[sizeof(T) * N / 16]; } v;
    v.t = t;
KILN_UNROLL
    for (int c = 0; c < (int)(sizeof(T) * N / 16); ++c) reinterpret_cast<word*>(&cell)[c] = v.w[c];
  } else {
    cell = t;
  }
}
template <class T, int N> KILN_FN tile<T, N> kept_tile(const tile<T, N>& cell) {
  if constexpr ((sizeof(T) * N) % 16 == 0) {
    struct alignas(16) word { unsigned u[4]; };
    union { tile<T, N> t; word w[sizeof(T) * N / 16]; } v;
KILN_UNROLL
    for (int c = 0; c < (int)(sizeof(T) * N / 16); ++c) v.w[c] = reinterpret_cast<const word*>(&cell)[c];
    return v.t;
  } else {
    return cell;
  }
}
// Transposed tiles (codegen/kernel_writer_tiles.hpp): a TILE x TILE square staged in shared memory,
// padded by a column. The staging pass puts a thread's values at column threadIdx.x % TILE of rows
// threadIdx.x / TILE + TROWS * k; the computing pass reads row threadIdx.x % TILE at those columns:
// neighbouring lanes hit neighbouring banks both ways.
template <int TILE, int TROWS, class T, int K>
KILN_FN void stage_put(T (&s)[TILE][TILE + 1], const tile<T, K>& v) {
  static_assert(K * TROWS == TILE, "a thread's values fill its column of the tile");
KILN_UNROLL
  for (int k = 0; k < K; ++k) s[threadIdx.x / TILE + TROWS * k][threadIdx.x % TILE] = v.v[k];
}
template <int TILE, int TROWS, class T>
KILN_FN tile<T, TILE / TROWS> stage_get(const T (&s)[TILE][TILE + 1]) {
  tile<T, TILE / TROWS> r;
KILN_UNROLL
  for (int k = 0; k < TILE / TROWS; ++k) r.v[k] = s[threadIdx.x % TILE][threadIdx.x / TILE + TROWS * k];
  return r;
}
#endif

// ---- reductions -----------------------------------------------------------------------------
struct op_sum { template <class T> KILN_FN T operator()(T a, T b) const { return a + b; } };
struct op_max { template <class T> KILN_FN T operator()(T a, T b) const { return maximum(a, b); } };
struct op_min { template <class T> KILN_FN T operator()(T a, T b) const { return minimum(a, b); } };

// Folds one tile into a scalar; a scalar stays itself.
template <class Op, class A> KILN_FN auto fold(Op op, const A& a) {
  if constexpr (tile_traits<A>::width == 0) {
    return a;
  } else {
    auto r = a.v[0];
KILN_UNROLL
    for (int i = 1; i < tile_traits<A>::width; ++i) r = op(r, a.v[i]);
    return r;
  }
}
// Combines the partial results of the ROW_THREADS threads that share a row. SLOT >= 0 names the
// reduction's own shared buffer (the kernel writer gives slots to register-cached rows of their own
// block with two or more reductions): every reduction of such a kernel runs once a row, in the same
// order, unconditionally, in a row loop all of the block's threads run equally often, so a slot's
// next write comes after every thread passed another slot's barrier, hence after every read of it,
// and one barrier a reduction suffices. SLOT -1 (every other kernel) waits for earlier readers first.
template <int ROW_THREADS, int SLOT, class Op, class T> KILN_FN T across_row(Op op, T v) {
#ifdef KILN_DEVICE_CODE
KILN_UNROLL
  for (int o = (ROW_THREADS < 32 ? ROW_THREADS : 32) / 2; o > 0; o >>= 1) v = op(v, static_cast<T>(__shfl_xor_sync(0xffffffffu, v, o)));  // (a bool comes back an int)
  if constexpr (ROW_THREADS > 32) {
    __shared__ T partial[32];
    const int warp = threadIdx.x / 32, nwarps = ROW_THREADS / 32;
    const int first = (threadIdx.x / ROW_THREADS) * nwarps;  // this row's warps (several rows a block)
    if constexpr (SLOT < 0) __syncthreads();  // earlier readers of `partial` are done
    if (threadIdx.x % 32 == 0) partial[warp] = v;
    __syncthreads();
    v = partial[first];
    for (int w = 1; w < nwarps; ++w) v = op(v, partial[first + w]);
  }
#endif
  return v;
}
// Folds the column partials of a block's ROWS row slots into the first slot's, slot by slot in
// order (the same sums in the same order at every launch), through one row of shared memory: each
// slot's tiles cover the same columns (KILN_R_TILES), so a thread adds the tiles of the threads
// ROW_THREADS, 2 * ROW_THREADS, ... after it. Every thread of the block calls it equally often.
template <int ROWS, int ROW_THREADS, int RITERS, class T, int N> KILN_FN void fold_row_slots(tile<T, N> (&part)[RITERS]) {
#ifdef KILN_DEVICE_CODE
  if constexpr (ROWS > 1) {
    __shared__ T row[RITERS * ROW_THREADS * N];  // [tile][thread][lane]: one row slot's sums
    const int slot = threadIdx.x / ROW_THREADS, at = (threadIdx.x % ROW_THREADS) * N;
    for (int s = 1; s < ROWS; ++s) {
      if (slot == s) {
KILN_UNROLL
        for (int it = 0; it < RITERS; ++it)
KILN_UNROLL
          for (int i = 0; i < N; ++i) row[it * ROW_THREADS * N + at + i] = part[it].v[i];
      }
      __syncthreads();
      if (slot == 0) {
KILN_UNROLL
        for (int it = 0; it < RITERS; ++it)
KILN_UNROLL
          for (int i = 0; i < N; ++i) part[it].v[i] += row[it * ROW_THREADS * N + at + i];
      }
      __syncthreads();  // the row is free for the next slot (and the next fold)
    }
  }
#endif
}
// GPU column blocks (reductions over outer dims): XT threads across the kept elements, each with a
// tile of adjacent ones, by RT threads down the reduced elements. Combines each thread's tile with
// those of the RT threads of its columns through shared memory; every thread gets the result.
// Every thread of the block calls it equally often (the block's loop is the same for all).
template <int XT, int RT, class Op, class T, int N> KILN_FN tile<T, N> across_columns(Op op, const tile<T, N>& a) {
#ifdef KILN_DEVICE_CODE
  if constexpr (RT > 1) {
    __shared__ T part[RT * N * XT];  // [rt][lane][xt]: a warp's stores are consecutive words
    const int xt = threadIdx.x % XT, rt = threadIdx.x / XT;
    __syncthreads();  // an earlier combine's readers are done
KILN_UNROLL
    for (int i = 0; i < N; ++i) part[(rt * N + i) * XT + xt] = a.v[i];
    __syncthreads();
    tile<T, N> r;
KILN_UNROLL
    for (int i = 0; i < N; ++i) {
      T v = part[i * XT + xt];
      for (int k = 1; k < RT; ++k) v = op(v, part[(k * N + i) * XT + xt]);
      r.v[i] = v;
    }
    return r;
  }
#endif
  return a;
}
// The threads of a column block that store its results: the first of each column's RT.
template <int XT> KILN_FN bool column_leader() {
#ifdef KILN_DEVICE_CODE
  return threadIdx.x < XT;
#else
  return true;
#endif
}
template <int ROW_THREADS, int SLOT = -1, class A> KILN_FN auto row_sum(const A& a) { return across_row<ROW_THREADS, SLOT>(op_sum(), fold(op_sum(), a)); }
template <int ROW_THREADS, int SLOT = -1, class A> KILN_FN auto row_max(const A& a) { return across_row<ROW_THREADS, SLOT>(op_max(), fold(op_max(), a)); }
template <int ROW_THREADS, int SLOT = -1, class A> KILN_FN auto row_min(const A& a) { return across_row<ROW_THREADS, SLOT>(op_min(), fold(op_min(), a)); }
}  // namespace kiln

)KILN";

}  // namespace kiln::codegen
