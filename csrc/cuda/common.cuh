// What every kernel of the "cuda" backend shares: launch shape, block reductions, loads, the K3 term and the chunks
// of packed sequences (one block per chunk of at most kChunk tokens, found by binary search).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <optional>

#include "acc_type.h"
#include "entry_points.h"
#include "loss_options.h"

namespace vcpo {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

constexpr int64_t kChunk = 4096;  // tokens per block of a segmented reduction
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr double kInf = INFINITY;

template <typename acc_t, typename T>
__device__ __forceinline__ acc_t ld(const T* p, int64_t i) {
  return static_cast<acc_t>(p[i]);
}

// Sum (or max) over the block; every thread gets the result. Fixed shape: deterministic.
template <typename T, bool Max = false>
__device__ T block_reduce(T v) {
  __shared__ T warp_out[kWarps];
  __shared__ T result;
  for (int o = 16; o > 0; o /= 2) {
    const T other = __shfl_down_sync(0xffffffffu, v, o);
    v = Max ? (other > v || other != other ? other : v) : v + other;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_out[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    T r = warp_out[0];
    for (int w = 1; w < kWarps; ++w) r = Max ? (warp_out[w] > r || warp_out[w] != warp_out[w] ? warp_out[w] : r)
                                             : r + warp_out[w];
    result = r;
  }
  __syncthreads();
  const T out = result;
  __syncthreads();  // the shared slots are reused by the next call
  return out;
}

__device__ __forceinline__ bool finite(double x) { return x == x && fabs(x) < kInf; }

// exp(d) - 1 - d without cancellation (Taylor series to d^10 for |d| < 0.1).
template <typename acc_t>
__device__ __forceinline__ acc_t k3_term(acc_t d) {
  if (fabs(static_cast<double>(d)) >= 0.1) return exp(d) - acc_t(1) - d;
  acc_t q = acc_t(1.0 / 3628800.0);
  q = q * d + acc_t(1.0 / 362880.0);
  q = q * d + acc_t(1.0 / 40320.0);
  q = q * d + acc_t(1.0 / 5040.0);
  q = q * d + acc_t(1.0 / 720.0);
  q = q * d + acc_t(1.0 / 120.0);
  q = q * d + acc_t(1.0 / 24.0);
  q = q * d + acc_t(1.0 / 6.0);
  q = q * d + acc_t(0.5);
  return d * d * q;
}

// ---- chunks of sequences ------------------------------------------------------------------------------

struct Tokens {
  const void* logp;
  const void* behavior;
  const void* old;   // nullptr: bypass mode
  const bool* mask;  // nullptr: every token counts
  const int64_t* cu;
  const int64_t* chunk_end;  // chunks of sequences 0..i
  int64_t num_seqs, num_tokens;
  bool aligned;  // every token array (and the gradient) starts on a 16-byte boundary: vector loads allowed
};

// 16 bytes of logp per vector load: 4 fp32, 8 bf16/fp16, 2 fp64 (behavior_logp in fp32 beside bf16 logp
// takes two 16-byte loads).
template <typename lp_t>
constexpr int kVec = 16 / sizeof(lp_t);

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p, int64_t i) {
  return *reinterpret_cast<const Pack<T, N>*>(p + i);
}

// Calls body(i, counted, lp, mu, old) for every token i of [first, last) that this thread owns, with the token
// values in acc_t (old = lp in bypass mode), and stores the returned value to out[i] when out is given. The
// aligned middle of the span is read with 16-byte vector loads, kVec<lp_t> tokens per thread per step; the
// ragged ends and unaligned arrays element by element.
template <typename lp_t, typename ref_t, typename acc_t, typename Body>
__device__ __forceinline__ void visit_tokens(const Tokens& t, int64_t first, int64_t last, lp_t* out, Body&& body) {
  constexpr int V = kVec<lp_t>;
  const lp_t* lp = static_cast<const lp_t*>(t.logp);
  const ref_t* mu = static_cast<const ref_t*>(t.behavior);
  const ref_t* old = static_cast<const ref_t*>(t.old);
  auto one = [&](int64_t i) {
    const bool counted = t.mask == nullptr || t.mask[i];
    const acc_t cur = ld<acc_t>(lp, i);
    const acc_t r = body(i, counted, cur, ld<acc_t>(mu, i), old ? ld<acc_t>(old, i) : cur);
    if (out) out[i] = static_cast<lp_t>(r);
  };
  int64_t head_end = first, body_end = first;
  if (t.aligned) {
    head_end = min(last, (first + V - 1) / V * V);
    body_end = head_end + (last - head_end) / V * V;
  }
  for (int64_t i = first + threadIdx.x; i < head_end; i += blockDim.x) one(i);
  for (int64_t base = head_end + int64_t(threadIdx.x) * V; base < body_end; base += int64_t(blockDim.x) * V) {
    const Pack<lp_t, V> l = load_pack<V>(lp, base);
    const Pack<ref_t, V> m = load_pack<V>(mu, base);
    Pack<ref_t, V> o;
    if (old) o = load_pack<V>(old, base);
    Pack<bool, V> k;
    if (t.mask) k = load_pack<V>(t.mask, base);
    Pack<lp_t, V> g;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const acc_t cur = static_cast<acc_t>(l.v[j]);
      g.v[j] = static_cast<lp_t>(body(base + j, t.mask == nullptr || k.v[j], cur, static_cast<acc_t>(m.v[j]),
                                      old ? static_cast<acc_t>(o.v[j]) : cur));
    }
    if (out) *reinterpret_cast<Pack<lp_t, V>*>(out + base) = g;
  }
  for (int64_t i = max(body_end, first) + threadIdx.x; i < last; i += blockDim.x) one(i);
}

struct Span {
  int64_t seq, first, last;  // seq == num_seqs: past the last chunk
};

// The chunk of block `pid`: binary search for the first sequence whose chunk_end exceeds pid, then the span
// clipped to [0, num_tokens).
__device__ Span chunk_span(const Tokens& t, int64_t pid) {
  int64_t lo = 0, hi = t.num_seqs;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (t.chunk_end[mid] <= pid) lo = mid + 1; else hi = mid;
  }
  if (lo >= t.num_seqs) return {t.num_seqs, 0, 0};
  const int64_t start = t.cu[lo], stop = t.cu[lo + 1];
  const int64_t first_chunk = t.chunk_end[lo] - (stop - start + kChunk - 1) / kChunk;
  int64_t first = start + (pid - first_chunk) * kChunk;
  int64_t last = min(min(first + kChunk, stop), t.num_tokens);
  first = max(first, int64_t(0));
  return {lo, first, last};
}

// (chunk_end, grid) for the packed offsets: no host sync, the grid is an upper bound of the chunk count.
std::pair<Tensor, int64_t> chunk_plan(const Tensor& cu, int64_t num_tokens) {
  const int64_t b = cu.numel() - 1;
  const Tensor lengths = cu.slice(0, 1) - cu.slice(0, 0, b);
  const Tensor chunk_end = at::cumsum(at::div(lengths + (kChunk - 1), kChunk, "floor"), 0).contiguous();
  return {chunk_end, num_tokens / kChunk + b};
}

// out[j, i]: the sum (Max: the maximum, a NaN winning) of sequence i's chunk partials [c, j], in chunk order.
template <typename acc_t, bool Max = false>
__global__ void combine_kernel(const acc_t* partials, const int64_t* chunk_end, int64_t num_seqs, int64_t num_parts,
                               int k, acc_t* out) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= num_seqs) return;
  const int64_t begin = max(i > 0 ? chunk_end[i - 1] : int64_t(0), int64_t(0));
  const int64_t end = min(chunk_end[i], num_parts);
  for (int j = 0; j < k; ++j) {
    acc_t r = Max ? acc_t(-INFINITY) : acc_t(0);
    for (int64_t c = begin; c < end; ++c) {
      const acc_t x = partials[c * k + j];
      r = Max ? (x > r || x != x ? x : r) : r + x;
    }
    out[j * num_seqs + i] = r;
  }
}

}  // namespace
}  // namespace vcpo
