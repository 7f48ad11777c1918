// The passes over a chunk of logits of linear_logprobs. Part of the "cuda" backend (ops.cu: the entry points;
// docs/contract.md: the math).
#pragma once

#include "common.cuh"

namespace vcpo {
namespace {

// Each row of V logits is cut into segments of kRowSegment; one block per (row, segment), so that even the ~100
// rows of a chunk at V = 152k make thousands of blocks. The forward reduces a segment to (max, sum e, sum e x,
// sum e^2) with e = exp(z - max), x = z - max (the second read of the segment hits the cache), then one thread
// per row merges its segments in order: deterministic, and every row read once from memory.
constexpr int64_t kRowSegment = kThreads * 16;

int64_t row_segments(int64_t vocab) { return std::max<int64_t>((vocab + kRowSegment - 1) / kRowSegment, 1); }

template <typename acc_t>
struct SegmentSums {
  acc_t max, s, sx, s2;
};

// The logit as the passes read it: c tanh(z / c) with a softcap c > 0, else z (csrc/cpu/logit_rows.h).
template <typename acc_t>
__device__ __forceinline__ acc_t read_logit(acc_t z, acc_t cap) {
  return cap > 0 ? cap * tanh(z / cap) : z;
}

// d (c tanh(z / c)) / d z = 1 - tanh^2(z / c) = 4 e / (1 + e)^2 with e = exp(-2 |z / c|): relative even where
// tanh rounds to +-1.
template <typename acc_t>
__device__ __forceinline__ acc_t cap_slope(acc_t z, acc_t cap) {
  const acc_t e = exp(-2 * fabs(z / cap));
  return 4 * e / ((1 + e) * (1 + e));
}

template <typename acc_t>
__global__ void logit_segments_kernel(const acc_t* z, int64_t vocab, int64_t segments, acc_t cap,
                                      SegmentSums<acc_t>* out) {
  const int64_t row = blockIdx.x / segments, seg = blockIdx.x % segments;
  const acc_t* zr = z + row * vocab;
  const int64_t first = seg * kRowSegment, last = min(first + kRowSegment, vocab);
  acc_t m = -INFINITY;
  for (int64_t v = first + threadIdx.x; v < last; v += blockDim.x) m = (zr[v] > m || zr[v] != zr[v]) ? zr[v] : m;
  m = read_logit(block_reduce<acc_t, true>(m), cap);  // tanh rises: the capped max is the max of the capped
  acc_t s = 0, sx = 0, s2 = 0;
  if (m != -INFINITY) {  // an all -inf segment keeps zeros here; the merge then treats it as the row pass would
    for (int64_t v = first + threadIdx.x; v < last; v += blockDim.x) {
      const acc_t x = read_logit(zr[v], cap) - m, e = exp(x);
      s += e;
      sx += e * x;
      s2 += e * e;
    }
  }
  s = block_reduce(s);
  sx = block_reduce(sx);
  s2 = block_reduce(s2);
  if (threadIdx.x == 0) out[blockIdx.x] = {m, s, sx, s2};
}

// lse, logp, entropy and sum p^2 of each row from its segments (csrc/cpu/logit_rows.h has the same formulas):
// rescaled to the row's max M, a segment with max m contributes f = exp(m - M) times its s and s2 (f^2),
// and f (sx + (m - M) s) to sum e x. As in one pass over the row, a -inf logit makes sum e x NaN (0 * -inf),
// and NaN or +inf logits make every output NaN (with a softcap c, -+inf logits read as -+c; NaN stays NaN).
template <typename acc_t>
__global__ void logit_rows_merge_kernel(const acc_t* z, const SegmentSums<acc_t>* parts, const int64_t* targets,
                                        int64_t n, int64_t vocab, int64_t segments, int64_t ignore, acc_t cap,
                                        acc_t* lse_out, acc_t* logp, acc_t* entropy, acc_t* sum_p2) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (row >= n) return;
  const SegmentSums<acc_t>* p = parts + row * segments;
  acc_t m = -INFINITY;
  for (int64_t j = 0; j < segments; ++j) m = (p[j].max > m || p[j].max != p[j].max) ? p[j].max : m;
  acc_t s = 0, sx = 0, s2 = 0;
  for (int64_t j = 0; j < segments; ++j) {
    const acc_t d = p[j].max - m, f = exp(d);
    s += f * p[j].s;
    sx += f * (p[j].sx + d * p[j].s);
    s2 += f * f * p[j].s2;
  }
  const int64_t y = targets[row];
  const bool counts = y != ignore && y >= 0 && y < vocab;
  const acc_t log_s = log(s), lse = m + log_s;
  lse_out[row] = lse;
  logp[row] = counts ? read_logit(z[row * vocab + y], cap) - lse : acc_t(0);
  entropy[row] = counts ? log_s - sx / s : acc_t(0);
  sum_p2[row] = counts ? s2 / (s * s) : acc_t(0);
}

// d z of every (row, segment) block, in place: p (c0 - e x + 2 q p) + a [v == y], times scale (and times the
// cap's slope with a softcap).
template <typename acc_t>
__global__ void logit_rows_backward_kernel(acc_t* z, const acc_t* lse, const int64_t* targets, int64_t vocab,
                                           int64_t segments, int64_t ignore, const acc_t* g_logp, const acc_t* g_ent,
                                           const acc_t* g_p2, const acc_t* entropy, const acc_t* sum_p2, acc_t scale,
                                           acc_t cap) {
  const int64_t row = blockIdx.x / segments, seg = blockIdx.x % segments;
  acc_t* zr = z + row * vocab;
  const int64_t first = seg * kRowSegment, last = min(first + kRowSegment, vocab);
  const int64_t y = targets[row];
  if (y == ignore || y < 0 || y >= vocab) {
    for (int64_t v = first + threadIdx.x; v < last; v += blockDim.x) zr[v] = 0;
    return;
  }
  const acc_t a = g_logp ? g_logp[row] : acc_t(0), e = g_ent ? g_ent[row] : acc_t(0);
  const acc_t q = g_p2 ? g_p2[row] : acc_t(0);
  const acc_t c0 = -a - (g_ent ? e * entropy[row] : acc_t(0)) - (g_p2 ? 2 * q * sum_p2[row] : acc_t(0));
  const acc_t l = lse[row];
  for (int64_t v = first + threadIdx.x; v < last; v += blockDim.x) {
    const acc_t zv = zr[v], x = read_logit(zv, cap) - l, pv = exp(x);
    const acc_t d = (pv * (c0 - e * x + 2 * q * pv) + (v == y ? a : acc_t(0))) * scale;
    zr[v] = cap > 0 ? d * cap_slope(zv, cap) : d;
  }
}

}  // namespace
}  // namespace vcpo
