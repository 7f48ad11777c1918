// CUDA implementations of the vcpo:: ops (schemas in csrc/registration.cpp; math in docs/contract.md), the
// same pipeline as the Triton backend (vcpo_kernels/triton/): per-chunk partial sums of the tokens (read with
// 16-byte vector loads where aligned) combined per sequence in chunk order, one block for the batch step
// (ESS, a_i c_i), one block per group (baselines), one block per chunk for the token pass; fp64 for the
// per-batch and per-group sums. No float atomics (every result is deterministic) and no host sync: every
// count stays on the device.
// Python validates the arguments; the checks here are those of shapes, dtypes and devices, and every index
// read from a tensor is clipped so that unvalidated input cannot read or write out of bounds.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "acc_type.h"
#include "entry_points.h"
#include "loss_options.h"

#include <cmath>
#include <optional>

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

template <typename acc_t>
__global__ void combine_kernel(const acc_t* partials, const int64_t* chunk_end, int64_t num_seqs, int64_t num_parts,
                               int k, acc_t* out) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= num_seqs) return;
  const int64_t begin = max(i > 0 ? chunk_end[i - 1] : int64_t(0), int64_t(0));
  const int64_t end = min(chunk_end[i], num_parts);
  for (int j = 0; j < k; ++j) {
    acc_t sum = 0;
    for (int64_t c = begin; c < end; ++c) sum += partials[c * k + j];
    out[j * num_seqs + i] = sum;
  }
}

// ---- per-sequence sums ----------------------------------------------------------------------------------

template <typename lp_t, typename ref_t, typename acc_t>
__global__ void sequence_partials_kernel(Tokens t, acc_t* partials) {
  const Span sp = chunk_span(t, blockIdx.x);
  if (sp.seq >= t.num_seqs) return;  // uniform over the block
  acc_t s = 0, len = 0, k3 = 0;
  visit_tokens<lp_t, ref_t, acc_t>(t, sp.first, sp.last, static_cast<lp_t*>(nullptr),
                                   [&](int64_t, bool counted, acc_t, acc_t mu, acc_t prox) {
    if (counted) {
      const acc_t d = prox - mu;
      s += d;
      len += 1;
      k3 += k3_term(d);
    }
    return acc_t(0);
  });
  s = block_reduce(s);
  len = block_reduce(len);
  k3 = block_reduce(k3);
  if (threadIdx.x == 0) {
    partials[blockIdx.x * 3] = s;
    partials[blockIdx.x * 3 + 1] = len;
    partials[blockIdx.x * 3 + 2] = k3;
  }
}

// ---- ESS ------------------------------------------------------------------------------------------------

__device__ double lr_from_ratio(double ratio, double base, LrRule rule) {
  if (ratio != ratio) return 0.0;  // NaN weights skip the step, never a full lr
  const double x = min(ratio / base, 1.0);
  return rule == LrRule::Sqrt ? sqrt(x) : rule == LrRule::Linear ? x : 1.0;
}

// (ess, ratio, lr) over the valid sequences, by the whole block; truncate: min(lw, log_hi), NaN kept.
template <typename acc_t>
__device__ void ess_of(const acc_t* lw, const acc_t* length, int64_t n, bool truncate, double log_hi, double base,
                       LrRule rule, double* out) {
  double m = -kInf, count = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (length && !(length[i] > 0)) continue;
    double x = lw[i];
    if (truncate && x > log_hi) x = log_hi;
    m = (x > m || x != x) ? x : m;
    count += 1;
  }
  m = block_reduce<double, true>(m);
  count = block_reduce(count);
  const double shift = finite(m) ? m : 0.0;  // +inf/NaN propagate; all -inf gives 0/0
  double s1 = 0, s2 = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (length && !(length[i] > 0)) continue;
    double x = lw[i];
    if (truncate && x > log_hi) x = log_hi;
    const double e = exp(x - shift);
    s1 += e;
    s2 += e * e;
  }
  s1 = block_reduce(s1);
  s2 = block_reduce(s2);
  const double ess = count > 0 ? s1 * s1 / s2 : 0.0;
  const double ratio = count > 0 ? ess / count : 0.0;
  out[0] = ess;
  out[1] = ratio;
  out[2] = lr_from_ratio(ratio, base, rule);
}

template <typename acc_t>
__global__ void ess_kernel(const acc_t* lw, const acc_t* length, int64_t n, double base, LrRule rule, acc_t* out) {
  double r[3];
  ess_of(lw, length, n, false, 0.0, base, rule, r);
  if (threadIdx.x == 0) {
    for (int j = 0; j < 3; ++j) out[j] = static_cast<acc_t>(r[j]);
  }
}

// ---- baselines and advantages ---------------------------------------------------------------------------

struct Groups {
  const void* rewards;
  const void* length;        // nullptr: every sequence valid
  const int64_t* group;      // nullptr: one group
  int64_t num_seqs, num_groups;
  // OPOB weights: log W = 2 w(s) + log G (- 2 log L), w(s) = s | min(s, log C) | s + min(s, log C)
  const void* log_weight;    // nullptr: not OPOB
  const void* grad_sq_norm;  // nullptr: G = 1
  bool length_norm;
  OpobWeight weight;
  double log_hi;
  // Group grp's members are order[start[grp]:start[grp + 1]] (from members_by_group; nullptr: one group).
  const int64_t* order;
  const int64_t* start;
};

// Sequences sorted by group, stably (members keep their order), and where each group's run starts: each
// group's block then reads its own members only, O(B) in all instead of O(groups x B). A device sort and
// search: no host sync, deterministic. Out-of-range (unvalidated) indices sort outside every run.
std::pair<Tensor, Tensor> members_by_group(const Tensor& group_index, int64_t num_groups) {
  const auto [sorted, order] = at::sort(group_index, /*stable=*/true);
  const Tensor start = at::searchsorted(sorted, at::arange(num_groups + 1, group_index.options()));
  return {order.contiguous(), start.contiguous()};
}

template <typename acc_t>
__device__ __forceinline__ bool valid(const Groups& g, int64_t i) {
  return g.length == nullptr || static_cast<const acc_t*>(g.length)[i] > 0;
}

template <typename acc_t>
__device__ __forceinline__ double opob_log_w(const Groups& g, int64_t i) {
  const double s = static_cast<const acc_t*>(g.log_weight)[i];
  const double trunc = s > g.log_hi ? g.log_hi : s;
  const double w = g.weight == OpobWeight::Truncated ? trunc : g.weight == OpobWeight::ReferenceCompat ? s + trunc : s;
  double lw = 2.0 * w;
  if (g.grad_sq_norm) lw += log(static_cast<double>(static_cast<const acc_t*>(g.grad_sq_norm)[i]));
  if (g.length_norm) lw -= 2.0 * log(static_cast<double>(static_cast<const acc_t*>(g.length)[i]));
  return lw;
}

// stats[:, g] = (count, mean, population variance, baseline) of group g's valid members: one block per group,
// reading its members only.
template <typename acc_t>
__global__ void group_stats_kernel(Groups g, double* stats) {
  const int64_t grp = blockIdx.x;
  const int64_t begin = g.start ? g.start[grp] : 0, end = g.start ? g.start[grp + 1] : g.num_seqs;
  const acc_t* r = static_cast<const acc_t*>(g.rewards);
  double count = 0, total = 0;
  for (int64_t k = begin + threadIdx.x; k < end; k += blockDim.x) {
    const int64_t i = g.order ? g.order[k] : k;
    if (!valid<acc_t>(g, i)) continue;
    count += 1;
    total += r[i];
  }
  count = block_reduce(count);
  total = block_reduce(total);
  const double mean = count > 0 ? total / count : 0.0;
  double sq = 0, shift = -kInf;
  for (int64_t k = begin + threadIdx.x; k < end; k += blockDim.x) {
    const int64_t i = g.order ? g.order[k] : k;
    if (!valid<acc_t>(g, i)) continue;
    const double d = r[i] - mean;
    sq += d * d;
    if (g.log_weight) {
      const double lw = opob_log_w<acc_t>(g, i);
      shift = (lw > shift || lw != lw) ? lw : shift;
    }
  }
  sq = block_reduce(sq);
  double baseline = mean;
  if (g.log_weight) {
    shift = block_reduce<double, true>(shift);
    const double safe = finite(shift) ? shift : 0.0;  // NaN/+inf propagate
    double sum_w = 0, sum_wd = 0;
    for (int64_t k = begin + threadIdx.x; k < end; k += blockDim.x) {
      const int64_t i = g.order ? g.order[k] : k;
      if (!valid<acc_t>(g, i)) continue;
      const double w = exp(opob_log_w<acc_t>(g, i) - safe);
      sum_w += w;
      sum_wd += w * (r[i] - mean);
    }
    sum_w = block_reduce(sum_w);
    sum_wd = block_reduce(sum_wd);
    // b = mean + sum W (R - mean) / sum W: exact for one member or equal rewards; every W = 0: the mean
    baseline = shift == -kInf ? mean : mean + sum_wd / sum_w;
  }
  if (threadIdx.x == 0) {
    stats[grp] = count;
    stats[g.num_groups + grp] = mean;
    stats[2 * g.num_groups + grp] = count > 0 ? sq / count : 0.0;
    stats[3 * g.num_groups + grp] = baseline;
  }
}

template <typename acc_t>
__global__ void advantages_kernel(Groups g, const double* stats, Advantage kind, bool norm_by_std, acc_t* adv) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= g.num_seqs) return;
  if (g.length && !(static_cast<const acc_t*>(g.length)[i] > 0)) {
    adv[i] = 0;
    return;
  }
  int64_t grp = g.group ? g.group[i] : 0;
  grp = grp >= 0 && grp < g.num_groups ? grp : 0;  // an unvalidated bad index must not read out of bounds
  const double n = stats[grp], mean = stats[g.num_groups + grp], var = stats[2 * g.num_groups + grp];
  const double b = stats[3 * g.num_groups + grp], r = static_cast<const acc_t*>(g.rewards)[i];
  double a = r;
  if (kind == Advantage::Opob) {
    a = r - b;
    const double sigma = sqrt(var);
    if (norm_by_std && sigma > 1e-8) a /= sigma;
  } else if (kind == Advantage::Grpo) {
    a = r - mean;
    if (norm_by_std) a /= (n > 1 ? sqrt(var * n / (n - 1)) : 0.0) + 1e-6;
  } else if (kind == Advantage::Rloo) {
    a = n > 1 ? (r - mean) * n / (n - 1) : 0.0;
  } else if (kind == Advantage::Reinforce) {
    a = r - mean;  // the stats are of the whole batch, one group
  }
  adv[i] = static_cast<acc_t>(a);
}

// (baseline [num_groups], advantages [B]) in acc_t of the given estimator.
template <typename acc_t>
std::pair<Tensor, Tensor> advantages(Groups g, const OptTensor& group_index, Advantage kind, bool norm_by_std,
                                     const at::TensorOptions& opts) {
  const int64_t num_groups = g.num_groups;
  Tensor order, start;
  if (kind == Advantage::Reinforce) {  // one batch-wide baseline
    g.group = nullptr;
    g.num_groups = 1;
  } else if (group_index) {
    std::tie(order, start) = members_by_group(*group_index, num_groups);
    g.order = order.data_ptr<int64_t>();
    g.start = start.data_ptr<int64_t>();
  }
  if (kind != Advantage::Opob) g.log_weight = nullptr;
  auto stream = at::cuda::getCurrentCUDAStream();
  Tensor stats = at::empty({4, g.num_groups}, opts.dtype(at::kDouble));
  group_stats_kernel<acc_t><<<g.num_groups, kThreads, 0, stream>>>(g, stats.data_ptr<double>());
  Tensor adv = at::empty({g.num_seqs}, opts);
  if (g.num_seqs > 0) {
    advantages_kernel<acc_t><<<(g.num_seqs + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
        g, stats.data_ptr<double>(), kind, norm_by_std, adv.data_ptr<acc_t>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  Tensor baseline = kind == Advantage::None        ? at::zeros({num_groups}, opts)
                    : kind == Advantage::Reinforce ? stats[3].expand({num_groups}).to(opts.dtype()).contiguous()
                                                   : stats[3].to(opts.dtype());
  return {baseline, adv};
}

// ---- the loss -------------------------------------------------------------------------------------------

using Params = LossParams<double>;  // cast to acc_t where read

template <typename acc_t>
__device__ __forceinline__ acc_t is_coef(acc_t lw, const Params& p) {
  if (p.correction == IsCorrection::Truncate) return exp(lw > acc_t(p.log_hi) ? acc_t(p.log_hi) : lw);
  if (p.correction == IsCorrection::Mask) return (lw >= acc_t(p.log_lo) && lw <= acc_t(p.log_hi)) ? acc_t(1) : acc_t(0);
  return acc_t(1);
}

template <typename acc_t>
__device__ __forceinline__ acc_t is_changed(acc_t lw, const Params& p) {
  const bool out = p.correction == IsCorrection::Truncate ? lw > acc_t(p.log_hi)
                   : p.correction == IsCorrection::Mask   ? !(lw >= acc_t(p.log_lo) && lw <= acc_t(p.log_hi))
                                             : false;
  return out ? acc_t(1) : acc_t(0);
}

// work[]: num_tokens, num_seqs, kl sum, non-finite count, ess, ratio, lr, sequence-level changed and coef sums
enum : int { kWTokens = 0, kWSeqs, kWKl, kWNonfinite, kWEss, kWRatio, kWLr, kWChanged, kWCoef, kNumWork };

template <typename acc_t>
__global__ void batch_step_kernel(const acc_t* s, const acc_t* length, const acc_t* kl, int64_t n, Params p,
                                  bool ess_on_corrected, double base, LrRule rule, LossAgg agg, double norm_length,
                                  acc_t* grad_scale, double* work) {
  double tokens = 0, seqs = 0, kl_sum = 0, nonfinite = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (!(length[i] > 0)) continue;
    tokens += length[i];
    seqs += 1;
    kl_sum += kl[i];
    nonfinite += finite(s[i]) ? 0.0 : 1.0;
  }
  tokens = block_reduce(tokens);
  seqs = block_reduce(seqs);
  kl_sum = block_reduce(kl_sum);
  nonfinite = block_reduce(nonfinite);
  double ess[3];
  ess_of(s, length, n, ess_on_corrected, p.log_hi, base, rule, ess);
  double changed = 0, coef = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double len = length[i];
    if (!(len > 0)) {
      grad_scale[i] = 0;
      continue;
    }
    const double a = agg == LossAgg::TokenMean           ? 1.0 / tokens
                     : agg == LossAgg::SeqMeanTokenMean ? 1.0 / (seqs * len)
                     : agg == LossAgg::SeqMeanTokenSum  ? 1.0 / seqs
                                                : 1.0 / (seqs * norm_length);
    acc_t c = 1;
    if (p.level != IsLevel::Token) {
      const acc_t lw = p.level == IsLevel::Geometric ? s[i] / static_cast<acc_t>(len) : s[i];
      c = is_coef(lw, p);
      changed += is_changed(lw, p);
      coef += c;
    }
    grad_scale[i] = static_cast<acc_t>(a * c);
  }
  changed = block_reduce(changed);
  coef = block_reduce(coef);
  if (threadIdx.x == 0) {
    const double w[kNumWork] = {tokens, seqs, kl_sum, nonfinite, ess[0], ess[1], ess[2], changed, coef};
    for (int j = 0; j < kNumWork; ++j) work[j] = w[j];
  }
}

// One chunk of tokens. Forward (WriteGrad false): partial sums of c p(r) (times grad_scale), changed units, c
// and clipped tokens. Backward: grad[t] = g grad_scale c (d p / d r) r, exactly 0 where the token does not
// count or its unit was removed (c = 0), even where r or A are not finite.
template <bool WriteGrad, typename lp_t, typename ref_t, typename acc_t>
__global__ void token_pass_kernel(Tokens t, Params p, const acc_t* adv_in, const acc_t* grad_scale,
                                  const acc_t* grad_loss, acc_t* partials, lp_t* grad) {
  const Span sp = chunk_span(t, blockIdx.x);
  if (sp.seq >= t.num_seqs) return;
  const acc_t adv = adv_in[sp.seq];
  const acc_t gs = grad_scale[sp.seq] * (WriteGrad ? *grad_loss : acc_t(1));
  const bool token_level = p.level == IsLevel::Token, has_old = t.old != nullptr;
  acc_t loss = 0, changed = 0, coef_sum = 0, clipped = 0;
  visit_tokens<lp_t, ref_t, acc_t>(t, sp.first, sp.last, WriteGrad ? grad : nullptr,
                                   [&](int64_t, bool counted, acc_t cur, acc_t mu, acc_t prox) {
    if (!counted) return acc_t(0);
    acc_t c = 1;
    if (token_level) {
      const acc_t d = prox - mu;
      c = is_coef(d, p);
      changed += is_changed(d, p);
      coef_sum += c;
    }
    const bool dropped = c == acc_t(0) || gs == acc_t(0);
    const acc_t r = has_old ? exp(dropped ? acc_t(0) : cur - prox) : acc_t(1);
    const acc_t p1 = -adv * r;
    acc_t val = p1, dval = -adv;
    bool on_clip = false;
    if (p.clip) {
      const acc_t rc = r < acc_t(p.ratio_lo) ? acc_t(p.ratio_lo) : (r > acc_t(p.ratio_hi) ? acc_t(p.ratio_hi) : r);
      const acc_t p2 = -adv * rc;
      const bool take_unclipped = p1 >= p2;  // ties go to the unclipped branch
      val = take_unclipped ? p1 : p2;
      dval = take_unclipped ? dval : acc_t(0);
      on_clip = !take_unclipped;
      const acc_t limit = -adv * acc_t(p.dual_c);
      const bool take_dual = p.dual_clip && adv < 0 && !(val <= limit);
      val = take_dual ? limit : val;
      dval = take_dual ? acc_t(0) : dval;
      on_clip = on_clip || take_dual;
    }
    clipped += on_clip ? acc_t(1) : acc_t(0);
    if (dropped) return acc_t(0);
    loss += c * val;
    return gs * c * dval * r;
  });
  if (WriteGrad) return;
  loss = block_reduce(loss);
  changed = block_reduce(changed);
  coef_sum = block_reduce(coef_sum);
  clipped = block_reduce(clipped);
  if (threadIdx.x == 0) {
    partials[blockIdx.x * 4] = gs != acc_t(0) ? gs * loss : acc_t(0);
    partials[blockIdx.x * 4 + 1] = changed;
    partials[blockIdx.x * 4 + 2] = coef_sum;
    partials[blockIdx.x * 4 + 3] = clipped;
  }
}

// The loss and the statistics (docs/contract.md, "Statistics"): from the chunk partials, or, when the token
// terms are constant within each sequence, from -sum_i grad_scale_i A_i L_i.
template <typename acc_t>
__global__ void finish_kernel(const acc_t* partials, int64_t num_parts, const double* work, const acc_t* grad_scale,
                              const acc_t* adv, const acc_t* length, int64_t n, bool token_pass, bool token_level,
                              acc_t* loss_out, acc_t* scalars) {
  double loss = 0, changed = 0, coef = 0, clipped = 0;
  if (token_pass) {
    for (int64_t j = threadIdx.x; j < num_parts; j += blockDim.x) {
      loss += partials[j * 4];
      changed += partials[j * 4 + 1];
      coef += partials[j * 4 + 2];
      clipped += partials[j * 4 + 3];
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      if (length[i] > 0 && grad_scale[i] != acc_t(0)) loss -= static_cast<double>(grad_scale[i]) * adv[i] * length[i];
    }
  }
  loss = block_reduce(loss);
  changed = block_reduce(changed);
  coef = block_reduce(coef);
  clipped = block_reduce(clipped);
  if (threadIdx.x != 0) return;
  const double tokens = work[kWTokens], seqs = work[kWSeqs];
  const double units = token_level ? tokens : seqs;
  const double unit_changed = token_level ? changed : work[kWChanged];
  const double unit_coef = token_level ? coef : work[kWCoef];
  const double out[kNumScalars] = {work[kWEss], work[kWRatio], work[kWLr],
                                   units > 0 ? unit_changed / units : 0.0, units > 0 ? unit_coef / units : 0.0,
                                   tokens > 0 ? work[kWKl] / tokens : 0.0, tokens, seqs, work[kWNonfinite],
                                   tokens > 0 ? clipped / tokens : 0.0};
  *loss_out = static_cast<acc_t>(loss);
  for (int j = 0; j < kNumScalars; ++j) scalars[j] = static_cast<acc_t>(out[j]);
}

// ---- logits of linear_logprobs --------------------------------------------------------------------------

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

template <typename acc_t>
__global__ void logit_segments_kernel(const acc_t* z, int64_t vocab, int64_t segments, SegmentSums<acc_t>* out) {
  const int64_t row = blockIdx.x / segments, seg = blockIdx.x % segments;
  const acc_t* zr = z + row * vocab;
  const int64_t first = seg * kRowSegment, last = min(first + kRowSegment, vocab);
  acc_t m = -INFINITY;
  for (int64_t v = first + threadIdx.x; v < last; v += blockDim.x) m = (zr[v] > m || zr[v] != zr[v]) ? zr[v] : m;
  m = block_reduce<acc_t, true>(m);
  acc_t s = 0, sx = 0, s2 = 0;
  if (m != -INFINITY) {  // an all -inf segment keeps zeros here; the merge then treats it as the row pass would
    for (int64_t v = first + threadIdx.x; v < last; v += blockDim.x) {
      const acc_t x = zr[v] - m, e = exp(x);
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
// and NaN or +inf logits make every output NaN.
template <typename acc_t>
__global__ void logit_rows_merge_kernel(const acc_t* z, const SegmentSums<acc_t>* parts, const int64_t* targets,
                                        int64_t n, int64_t vocab, int64_t segments, int64_t ignore, acc_t* lse_out,
                                        acc_t* logp, acc_t* entropy, acc_t* sum_p2) {
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
  logp[row] = counts ? z[row * vocab + y] - lse : acc_t(0);
  entropy[row] = counts ? log_s - sx / s : acc_t(0);
  sum_p2[row] = counts ? s2 / (s * s) : acc_t(0);
}

// d z of every (row, segment) block, in place: p (c0 - e x + 2 q p) + a [v == y], times scale.
template <typename acc_t>
__global__ void logit_rows_backward_kernel(acc_t* z, const acc_t* lse, const int64_t* targets, int64_t vocab,
                                           int64_t segments, int64_t ignore, const acc_t* g_logp, const acc_t* g_ent,
                                           const acc_t* g_p2, const acc_t* entropy, const acc_t* sum_p2, acc_t scale) {
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
    const acc_t x = zr[v] - l, pv = exp(x);
    zr[v] = (pv * (c0 - e * x + 2 * q * pv) + (v == y ? a : acc_t(0))) * scale;
  }
}

// ---- host side ------------------------------------------------------------------------------------------

// The device every tensor of the call must share: that of the op's first tensor, which must be a CUDA tensor.
at::Device cuda_device_of(const Tensor& anchor, const char* name) {
  TORCH_CHECK(anchor.is_cuda(), "vcpo: ", name, " is on ", anchor.device(),
              " but the op runs on CUDA: every input must be on one CUDA device");
  return anchor.device();
}

Tokens token_view(const Tensor& logp, const Tensor& behavior, const OptTensor& old, const OptTensor& mask,
                  const Tensor& cu, const Tensor& chunk_end) {
  check_token_inputs(logp, behavior, old, mask, cu, cuda_device_of(logp, "logp"));
  // Vector loads need each array to start on a multiple of its pack: 16 bytes of logp, as many tokens of the others.
  const int64_t vec = 16 / logp.element_size();
  auto on = [](const Tensor& x, int64_t bytes) { return reinterpret_cast<uintptr_t>(x.data_ptr()) % bytes == 0; };
  const bool aligned = on(logp, 16) && on(behavior, vec * behavior.element_size()) &&
                       (!old || on(*old, vec * old->element_size())) && (!mask || on(*mask, vec));
  return Tokens{logp.data_ptr(), behavior.data_ptr(), old ? old->data_ptr() : nullptr,
                mask ? mask->data_ptr<bool>() : nullptr, cu.data_ptr<int64_t>(), chunk_end.data_ptr<int64_t>(),
                cu.numel() - 1, logp.numel(), aligned};
}

int64_t blocks_for(int64_t n) { return (n + kThreads - 1) / kThreads; }

// [3, B] (s, L, k3) and the chunk plan.
template <typename lp_t, typename ref_t>
Tensor sequence_sums(const Tokens& t, int64_t grid, const at::TensorOptions& opts) {
  using acc_t = acc_type<lp_t>;
  auto stream = at::cuda::getCurrentCUDAStream();
  Tensor partials = at::zeros({std::max<int64_t>(grid, 1), 3}, opts);
  if (grid > 0 && t.num_seqs > 0) {
    sequence_partials_kernel<lp_t, ref_t, acc_t><<<grid, kThreads, 0, stream>>>(t, partials.data_ptr<acc_t>());
  }
  Tensor out = at::empty({3, t.num_seqs}, opts);
  if (t.num_seqs > 0) {
    combine_kernel<acc_t><<<blocks_for(t.num_seqs), kThreads, 0, stream>>>(
        partials.data_ptr<acc_t>(), t.chunk_end, t.num_seqs, partials.size(0), 3, out.data_ptr<acc_t>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<Tensor, Tensor, Tensor> sequence_stats_cuda(const Tensor& logp, const Tensor& behavior_logp,
                                                       const OptTensor& old_logp, const OptTensor& mask,
                                                       const Tensor& cu_seqlens) {
  const at::Device device = cuda_device_of(logp, "logp");
  const c10::cuda::CUDAGuard guard(device);
  const auto [chunk_end, grid_size] = chunk_plan(cu_seqlens, logp.numel());
  const int64_t grid = grid_size;  // a plain variable: lambdas capture it (C++17)
  const Tokens t = token_view(logp, behavior_logp, old_logp, mask, cu_seqlens, chunk_end);
  Tensor sums;
  dispatch_logp(logp, behavior_logp, [&](auto lp, auto ref) {
    sums = sequence_sums<decltype(lp), decltype(ref)>(t, grid, logp.options().dtype(acc_dtype(logp.scalar_type())));
  });
  return {sums[0], sums[1], sums[2]};
}

std::tuple<Tensor, Tensor, Tensor> effective_sample_size_cuda(const Tensor& log_weight, const OptTensor& seq_length,
                                                              double ess_base_ratio, int64_t lr_rule) {
  const at::Device device = cuda_device_of(log_weight, "log_weight");
  const c10::cuda::CUDAGuard guard(device);
  check_tensor(log_weight, "log_weight", device);
  TORCH_CHECK(log_weight.dim() == 1, "vcpo: log_weight must be 1-D");
  const auto dtype = log_weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, "vcpo: log_weight must be float32 or float64");
  check_seq(seq_length, "seq_length", log_weight.numel(), dtype, device);
  Tensor out = at::empty({3}, log_weight.options());
  AT_DISPATCH_FLOATING_TYPES(dtype, "vcpo_ess_cuda", [&] {
    ess_kernel<scalar_t><<<1, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        log_weight.data_ptr<scalar_t>(), seq_length ? seq_length->data_ptr<scalar_t>() : nullptr, log_weight.numel(),
        ess_base_ratio, static_cast<LrRule>(lr_rule), out.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out[0], out[1], out[2]};
}

std::tuple<Tensor, Tensor> opob_baseline_cuda(const Tensor& rewards, const Tensor& log_weight,
                                              const OptTensor& grad_sq_norm, const OptTensor& group_index,
                                              const OptTensor& seq_length, int64_t num_groups, bool length_norm,
                                              bool norm_by_std) {
  const at::Device device = cuda_device_of(log_weight, "log_weight");
  const c10::cuda::CUDAGuard guard(device);
  check_tensor(log_weight, "log_weight", device);
  const int64_t b = log_weight.numel();
  const auto dtype = log_weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, "vcpo: log_weight must be float32 or float64");
  TORCH_CHECK(num_groups >= 1, "vcpo: num_groups must be >= 1");
  check_seq(rewards, "rewards", b, dtype, device);
  check_seq(grad_sq_norm, "grad_sq_norm", b, dtype, device);
  check_seq(group_index, "group_index", b, at::kLong, device);
  check_seq(seq_length, "seq_length", b, dtype, device);
  TORCH_CHECK(!length_norm || seq_length, "vcpo: length_norm needs seq_length");
  std::pair<Tensor, Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(dtype, "vcpo_opob_cuda", [&] {
    const Groups g{rewards.data_ptr(), seq_length ? seq_length->data_ptr() : nullptr,
                   group_index ? group_index->data_ptr<int64_t>() : nullptr, b, num_groups, log_weight.data_ptr(),
                   grad_sq_norm ? grad_sq_norm->data_ptr() : nullptr, length_norm, OpobWeight::Raw, 0.0,
                   nullptr, nullptr};
    out = advantages<scalar_t>(g, group_index, Advantage::Opob, norm_by_std, log_weight.options());
  });
  return {out.first, out.second};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> policy_loss_cuda(
    const Tensor& logp, const Tensor& behavior_logp, const OptTensor& old_logp, const OptTensor& mask,
    const Tensor& cu_seqlens, const OptTensor& rewards, const OptTensor& advantages_in, const OptTensor& group_index,
    int64_t num_groups, const OptTensor& grad_sq_norm, c10::IntArrayRef codes, c10::ArrayRef<double> values) {
  const at::Device device = cuda_device_of(logp, "logp");
  const c10::cuda::CUDAGuard guard(device);
  const auto [chunk_end, grid_size] = chunk_plan(cu_seqlens, logp.numel());
  const int64_t grid = grid_size;  // a plain variable: lambdas capture it (C++17)
  const Tokens t = token_view(logp, behavior_logp, old_logp, mask, cu_seqlens, chunk_end);
  const int64_t b = t.num_seqs;
  const auto acc = acc_dtype(logp.scalar_type());
  TORCH_CHECK(rewards.has_value() != advantages_in.has_value(), "vcpo: pass exactly one of rewards, advantages");
  TORCH_CHECK(num_groups >= 1, "vcpo: num_groups must be >= 1");
  check_seq(rewards, "rewards", b, acc, device);
  check_seq(advantages_in, "advantages", b, acc, device);
  check_seq(grad_sq_norm, "grad_sq_norm", b, acc, device);
  check_seq(group_index, "group_index", b, at::kLong, device);
  const auto opts = logp.options().dtype(acc);
  const LossOptions o = unpack_loss_options(codes, values, advantages_in.has_value());
  const Params p = loss_params<double>(o);
  auto stream = at::cuda::getCurrentCUDAStream();
  Tensor loss = at::empty({}, opts), scalars = at::empty({kNumScalars}, opts), baseline, adv;
  Tensor grad_scale = at::empty({b}, opts), seq_log_weight;
  dispatch_logp(logp, behavior_logp, [&](auto lp, auto ref) {
    using lp_t = decltype(lp);
    using ref_t = decltype(ref);
    using acc_t = acc_type<lp_t>;
    const Tensor sums = sequence_sums<lp_t, ref_t>(t, grid, opts);
    seq_log_weight = sums[0];
    const Tensor length = sums[1].contiguous(), kl = sums[2].contiguous(), s = seq_log_weight.contiguous();
    Tensor work = at::empty({kNumWork}, opts.dtype(at::kDouble));
    batch_step_kernel<acc_t><<<1, kThreads, 0, stream>>>(
        s.data_ptr<acc_t>(), length.data_ptr<acc_t>(), kl.data_ptr<acc_t>(), b, p, o.ess_on_corrected,
        o.ess_base_ratio, o.lr_rule, o.loss_agg, o.norm_length, grad_scale.data_ptr<acc_t>(),
        work.data_ptr<double>());
    if (advantages_in) {
      baseline = at::zeros({num_groups}, opts);
      adv = at::where(length > 0, *advantages_in, at::zeros({}, opts));
    } else {
      const Groups g{rewards->data_ptr(), length.data_ptr(), group_index ? group_index->data_ptr<int64_t>() : nullptr,
                     b, num_groups, s.data_ptr(), grad_sq_norm ? grad_sq_norm->data_ptr() : nullptr,
                     o.opob_length_norm, o.opob_weight, o.log_threshold, nullptr, nullptr};
      std::tie(baseline, adv) = advantages<acc_t>(g, group_index, o.advantage, o.norm_by_std, opts);
    }
    const bool token_pass = old_logp.has_value() || o.is_level == IsLevel::Token;
    Tensor partials = at::zeros({std::max<int64_t>(grid, 1), 4}, opts);
    if (token_pass && grid > 0 && b > 0) {
      token_pass_kernel<false, lp_t, ref_t, acc_t><<<grid, kThreads, 0, stream>>>(
          t, p, adv.data_ptr<acc_t>(), grad_scale.data_ptr<acc_t>(), nullptr, partials.data_ptr<acc_t>(), nullptr);
    }
    finish_kernel<acc_t><<<1, kThreads, 0, stream>>>(
        partials.data_ptr<acc_t>(), token_pass ? grid : 0, work.data_ptr<double>(), grad_scale.data_ptr<acc_t>(),
        adv.data_ptr<acc_t>(), length.data_ptr<acc_t>(), b, token_pass, o.is_level == IsLevel::Token,
        loss.data_ptr<acc_t>(), scalars.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {loss, scalars, baseline, adv, seq_log_weight, grad_scale};
}

Tensor policy_loss_backward_cuda(const Tensor& grad_loss, const Tensor& logp, const Tensor& behavior_logp,
                                 const OptTensor& old_logp, const OptTensor& mask, const Tensor& cu_seqlens,
                                 const Tensor& grad_scale, const Tensor& advantages_in, c10::IntArrayRef codes,
                                 c10::ArrayRef<double> values) {
  const at::Device device = cuda_device_of(logp, "logp");
  const c10::cuda::CUDAGuard guard(device);
  const auto [chunk_end, grid_size] = chunk_plan(cu_seqlens, logp.numel());
  const int64_t grid = grid_size;  // a plain variable: lambdas capture it (C++17)
  const Tokens t = token_view(logp, behavior_logp, old_logp, mask, cu_seqlens, chunk_end);
  const auto acc = acc_dtype(logp.scalar_type());
  check_seq(grad_scale, "grad_scale", t.num_seqs, acc, device);
  check_seq(advantages_in, "advantages", t.num_seqs, acc, device);
  TORCH_CHECK(grad_loss.numel() == 1, "vcpo: grad_loss must be a scalar");
  const Tensor g = grad_loss.to(logp.device(), acc).reshape({1}).contiguous();  // read on the device: no sync
  const Params p = loss_params<double>(unpack_loss_options(codes, values, true));
  // Every token lies in a chunk of valid offsets, so each element is written; unvalidated bad offsets leave
  // some unwritten (never out of bounds).
  Tensor grad = at::empty_like(logp);
  if (grid == 0 || t.num_seqs == 0) return grad.zero_();
  dispatch_logp(logp, behavior_logp, [&](auto lp, auto ref) {
    using lp_t = decltype(lp);
    using ref_t = decltype(ref);
    using acc_t = acc_type<lp_t>;
    token_pass_kernel<true, lp_t, ref_t, acc_t><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        t, p, advantages_in.data_ptr<acc_t>(), grad_scale.data_ptr<acc_t>(), g.data_ptr<acc_t>(), nullptr,
        grad.data_ptr<lp_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> logit_rows_forward_cuda(const Tensor& logits, const Tensor& targets,
                                                                   int64_t ignore_index) {
  const at::Device device = cuda_device_of(logits, "logits");
  const c10::cuda::CUDAGuard guard(device);
  check_logits(logits, targets, device);
  const int64_t n = logits.size(0);
  Tensor lse = at::empty({n}, logits.options()), logp = at::empty({n}, logits.options()),
         entropy = at::empty({n}, logits.options()), sum_p2 = at::empty({n}, logits.options());
  if (n == 0) return {lse, logp, entropy, sum_p2};
  const int64_t vocab = logits.size(1), segments = row_segments(vocab);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "vcpo_logit_rows_forward_cuda", [&] {
    const int64_t bytes = n * segments * int64_t(sizeof(SegmentSums<scalar_t>));
    Tensor parts = at::empty({bytes}, logits.options().dtype(at::kByte));
    auto* p = reinterpret_cast<SegmentSums<scalar_t>*>(parts.data_ptr());
    logit_segments_kernel<scalar_t><<<n * segments, kThreads, 0, stream>>>(logits.data_ptr<scalar_t>(), vocab,
                                                                          segments, p);
    logit_rows_merge_kernel<scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(
        logits.data_ptr<scalar_t>(), p, targets.data_ptr<int64_t>(), n, vocab, segments, ignore_index,
        lse.data_ptr<scalar_t>(), logp.data_ptr<scalar_t>(), entropy.data_ptr<scalar_t>(), sum_p2.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {lse, logp, entropy, sum_p2};
}

void logit_rows_backward_cuda(const Tensor& logits, const Tensor& lse, const Tensor& targets, int64_t ignore_index,
                              const OptTensor& g_logp, const OptTensor& g_entropy, const OptTensor& g_sum_p2,
                              const OptTensor& entropy, const OptTensor& sum_p2, double scale) {
  const at::Device device = cuda_device_of(logits, "logits");
  const c10::cuda::CUDAGuard guard(device);
  check_logits(logits, targets, device);
  const int64_t n = logits.size(0);
  const auto dtype = logits.scalar_type();
  check_seq(lse, "lse", n, dtype, device);
  check_seq(g_logp, "g_logp", n, dtype, device);
  check_seq(g_entropy, "g_entropy", n, dtype, device);
  check_seq(g_sum_p2, "g_sum_p2", n, dtype, device);
  check_seq(entropy, "entropy", n, dtype, device);
  check_seq(sum_p2, "sum_p2", n, dtype, device);
  TORCH_CHECK(!g_entropy || entropy, "vcpo: g_entropy needs the forward's entropy");
  TORCH_CHECK(!g_sum_p2 || sum_p2, "vcpo: g_sum_p2 needs the forward's sum_p2");
  if (n == 0) return;
  AT_DISPATCH_FLOATING_TYPES(dtype, "vcpo_logit_rows_backward_cuda", [&] {
    auto ptr = [](const OptTensor& t) { return t ? t->data_ptr<scalar_t>() : nullptr; };
    const int64_t vocab = logits.size(1), segments = row_segments(vocab);
    logit_rows_backward_kernel<scalar_t><<<n * segments, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        logits.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(), vocab, segments,
        ignore_index, ptr(g_logp), ptr(g_entropy), ptr(g_sum_p2), ptr(entropy), ptr(sum_p2),
        static_cast<scalar_t>(scale));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(vcpo, CUDA, m) {
  m.impl("sequence_stats", &sequence_stats_cuda);
  m.impl("effective_sample_size", &effective_sample_size_cuda);
  m.impl("opob_baseline", &opob_baseline_cuda);
  m.impl("policy_loss", &policy_loss_cuda);
  m.impl("policy_loss_backward", &policy_loss_backward_cuda);
  m.impl("logit_rows_forward", &logit_rows_forward_cuda);
  m.impl("logit_rows_backward", &logit_rows_backward_cuda);
}

}  // namespace vcpo
