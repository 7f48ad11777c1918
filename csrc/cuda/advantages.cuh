// Group baselines and advantages of every estimator: one block per group over its own members, fp64. Part of the
// "cuda" backend (ops.cu: the entry points; docs/contract.md: the math).
#pragma once

#include "common.cuh"

namespace vcpo {
namespace {

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
  bool leave_one_out;  // OPOB's A_i against b_-i, the weighted mean of the other members
  // OPOB's b from the weighted quantiles (docs/contract.md, "Advantages"): median, or the winsorized mean between the
  // quantiles winsorize_low and winsorize_high
  OpobAggregation aggregation = OpobAggregation::Mean;
  double winsorize_low = 0, winsorize_high = 1;
};

// Rows of the per-group stats: count, mean, population variance, baseline, the largest OPOB weight share; with
// leave_one_out, the sums over the members shifted by their max (shift, sum_w, sum_wd) and over the members but
// the first argmax shifted by theirs (first, shift2, sum_w2, sum_wd2).
enum StatRow : int64_t { kCount, kMean, kVar, kBaseline, kShare, kShift, kSumW, kSumWd, kFirst, kShift2, kSumW2,
                         kSumWd2, kStatRows };

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

// (sum W, sum W (R - mean)) over group [begin, end)'s members but sequence `skip`, W = exp(log W - shift) (shift 0
// where it is not finite: NaN/+inf propagate); every thread gets them.
template <typename acc_t>
__device__ void shifted_sums(const Groups& g, int64_t begin, int64_t end, double mean, double shift, int64_t skip,
                             double& sum_w, double& sum_wd) {
  const acc_t* r = static_cast<const acc_t*>(g.rewards);
  const double safe = finite(shift) ? shift : 0.0;
  sum_w = 0;
  sum_wd = 0;
  for (int64_t k = begin + threadIdx.x; k < end; k += blockDim.x) {
    const int64_t i = g.order ? g.order[k] : k;
    if (!valid<acc_t>(g, i) || i == skip) continue;
    const double w = exp(opob_log_w<acc_t>(g, i) - safe);
    sum_w += w;
    sum_wd += w * (r[i] - mean);
  }
  sum_w = block_reduce(sum_w);
  sum_wd = block_reduce(sum_wd);
}

// W_j / max W of member i (shift: the group's max log W; every W = 0, shift -inf: 1, the members weigh equally).
template <typename acc_t>
__device__ __forceinline__ double shifted_weight(const Groups& g, int64_t i, double shift) {
  return shift == -kInf ? 1.0 : exp(opob_log_w<acc_t>(g, i) - shift);
}

// The weighted q-quantile of group [begin, end)'s rewards: the smallest R_k with F_k = sum_j W_j [R_j <= R_k] >=
// q sum_j W_j (tied rewards share F), the group's largest reward where rounding leaves none. O(n_g^2): each thread
// takes members k, each F_k a sum in member order. Every thread gets it.
template <typename acc_t>
__device__ double weighted_quantile(const Groups& g, int64_t begin, int64_t end, double shift, double total, double q) {
  const acc_t* r = static_cast<const acc_t*>(g.rewards);
  double smallest = kInf, largest = -kInf;
  for (int64_t k = begin + threadIdx.x; k < end; k += blockDim.x) {
    const int64_t i = g.order ? g.order[k] : k;
    if (!valid<acc_t>(g, i)) continue;
    double f = 0;
    for (int64_t m = begin; m < end; ++m) {
      const int64_t j = g.order ? g.order[m] : m;
      if (valid<acc_t>(g, j) && r[j] <= r[i]) f += shifted_weight<acc_t>(g, j, shift);
    }
    if (f >= q * total) smallest = fmin(smallest, double(r[i]));
    largest = fmax(largest, double(r[i]));
  }
  smallest = -block_reduce<double, true>(-smallest);
  largest = block_reduce<double, true>(largest);
  return smallest == kInf ? largest : smallest;
}

// OPOB's b of opob_aggregation median or winsorized_mean over group [begin, end) (count > 0 members; shift: the max
// log W, finite or -inf). winsorized: lo + sum W (clip(R, lo, hi) - lo) / sum W, exact for one member or equal rewards.
template <typename acc_t>
__device__ double robust_baseline(const Groups& g, int64_t begin, int64_t end, double shift) {
  const acc_t* r = static_cast<const acc_t*>(g.rewards);
  double total = 0;
  for (int64_t k = begin + threadIdx.x; k < end; k += blockDim.x) {
    const int64_t i = g.order ? g.order[k] : k;
    if (valid<acc_t>(g, i)) total += shifted_weight<acc_t>(g, i, shift);
  }
  total = block_reduce(total);
  if (g.aggregation == OpobAggregation::Median) return weighted_quantile<acc_t>(g, begin, end, shift, total, 0.5);
  const double lo = weighted_quantile<acc_t>(g, begin, end, shift, total, g.winsorize_low);
  const double hi = weighted_quantile<acc_t>(g, begin, end, shift, total, g.winsorize_high);
  double sum = 0;
  for (int64_t k = begin + threadIdx.x; k < end; k += blockDim.x) {
    const int64_t i = g.order ? g.order[k] : k;
    if (valid<acc_t>(g, i)) sum += shifted_weight<acc_t>(g, i, shift) * (fmin(fmax(double(r[i]), lo), hi) - lo);
  }
  sum = block_reduce(sum);
  return lo + sum / total;
}

// stats[:, g] (the rows of StatRow) of group g's valid members: one block per group, reading its members only.
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
  double baseline = mean, share = 0;
  const int64_t G = g.num_groups;
  if (g.log_weight) {
    shift = block_reduce<double, true>(shift);
    double sum_w, sum_wd;
    shifted_sums<acc_t>(g, begin, end, mean, shift, -1, sum_w, sum_wd);
    // b = mean + sum W (R - mean) / sum W: exact for one member or equal rewards; every W = 0: the mean
    baseline = shift == -kInf ? mean : mean + sum_wd / sum_w;
    if (g.aggregation != OpobAggregation::Mean && count > 0) {  // a NaN or +inf W: NaN, as the mean's
      baseline = (shift != shift || shift == kInf) ? NAN : robust_baseline<acc_t>(g, begin, end, shift);
    }
    // max W / sum W = 1 / sum exp(log W - max); every W = 0: 1 / n_g; a NaN or +inf W: NaN; no member: 0
    share = count == 0 ? 0.0 : (shift != shift || shift == kInf) ? NAN : shift == -kInf ? 1.0 / count : 1.0 / sum_w;
    if (g.leave_one_out) {
      double neg_first = -kInf;  // minus the group's first argmax (members keep their order in the run)
      for (int64_t k = begin + threadIdx.x; k < end; k += blockDim.x) {
        const int64_t i = g.order ? g.order[k] : k;
        if (valid<acc_t>(g, i) && opob_log_w<acc_t>(g, i) == shift) neg_first = fmax(neg_first, -double(i));
      }
      neg_first = block_reduce<double, true>(neg_first);
      const int64_t first = neg_first == -kInf ? -1 : static_cast<int64_t>(-neg_first);
      double shift2 = -kInf;
      for (int64_t k = begin + threadIdx.x; k < end; k += blockDim.x) {
        const int64_t i = g.order ? g.order[k] : k;
        if (!valid<acc_t>(g, i) || i == first) continue;
        const double lw = opob_log_w<acc_t>(g, i);
        shift2 = (lw > shift2 || lw != lw) ? lw : shift2;
      }
      shift2 = block_reduce<double, true>(shift2);
      double sum_w2, sum_wd2;
      shifted_sums<acc_t>(g, begin, end, mean, shift2, first, sum_w2, sum_wd2);
      if (threadIdx.x == 0) {
        stats[kShift * G + grp] = shift;
        stats[kSumW * G + grp] = sum_w;
        stats[kSumWd * G + grp] = sum_wd;
        stats[kFirst * G + grp] = static_cast<double>(first);
        stats[kShift2 * G + grp] = shift2;
        stats[kSumW2 * G + grp] = sum_w2;
        stats[kSumWd2 * G + grp] = sum_wd2;
      }
    }
  }
  if (threadIdx.x == 0) {
    stats[kCount * G + grp] = count;
    stats[kMean * G + grp] = mean;
    stats[kVar * G + grp] = count > 0 ? sq / count : 0.0;
    stats[kBaseline * G + grp] = baseline;
    stats[kShare * G + grp] = share;
  }
}

// R_i - b_-i (docs/contract.md): for i not its group's first argmax, the group's sums minus i's term (w_i <= 1
// while the argmax's 1 stays: no cancellation); for the argmax, the sums over the others shifted by their own max.
// No other member, or every other W = 0: the RLOO deviation (0 for one member); a NaN or +inf W: NaN.
template <typename acc_t>
__device__ double leave_one_out_deviation(const Groups& g, const double* stats, int64_t grp, int64_t i, double r) {
  const int64_t G = g.num_groups;
  const double n = stats[kCount * G + grp], d = r - stats[kMean * G + grp], shift = stats[kShift * G + grp];
  if (shift != shift || shift == kInf) return NAN;
  const bool is_first = static_cast<double>(i) == stats[kFirst * G + grp];
  if ((is_first ? stats[kShift2 * G + grp] : shift) == -kInf) return n > 1 ? d * n / (n - 1) : 0.0;
  const double w = exp(opob_log_w<acc_t>(g, i) - shift);
  const double den = is_first ? stats[kSumW2 * G + grp] : stats[kSumW * G + grp] - w;
  const double num = is_first ? stats[kSumWd2 * G + grp] : stats[kSumWd * G + grp] - w * d;
  return d - num / den;
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
  const int64_t G = g.num_groups;
  const double n = stats[kCount * G + grp], mean = stats[kMean * G + grp], var = stats[kVar * G + grp];
  const double b = stats[kBaseline * G + grp], r = static_cast<const acc_t*>(g.rewards)[i];
  double a = r;
  if (kind == Advantage::Opob) {
    a = g.leave_one_out ? leave_one_out_deviation<acc_t>(g, stats, grp, i, r) : r - b;
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

// (baseline [num_groups], advantages [B]) in acc_t of the given estimator, and the largest OPOB weight share of a
// group (0-d, double; 0 for another estimator).
template <typename acc_t>
std::tuple<Tensor, Tensor, Tensor> advantages(Groups g, const OptTensor& group_index, Advantage kind,
                                              bool norm_by_std, const at::TensorOptions& opts) {
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
  if (kind != Advantage::Opob) {
    g.log_weight = nullptr;
    g.leave_one_out = false;
  }
  auto stream = at::cuda::getCurrentCUDAStream();
  Tensor stats = at::empty({kStatRows, g.num_groups}, opts.dtype(at::kDouble));
  group_stats_kernel<acc_t><<<g.num_groups, kThreads, 0, stream>>>(g, stats.data_ptr<double>());
  Tensor adv = at::empty({g.num_seqs}, opts);
  if (g.num_seqs > 0) {
    advantages_kernel<acc_t><<<(g.num_seqs + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
        g, stats.data_ptr<double>(), kind, norm_by_std, adv.data_ptr<acc_t>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  Tensor baseline = kind == Advantage::None        ? at::zeros({num_groups}, opts)
                    : kind == Advantage::Reinforce ? stats[kBaseline].expand({num_groups}).to(opts.dtype()).contiguous()
                                                   : stats[kBaseline].to(opts.dtype());
  Tensor share = kind == Advantage::Opob ? at::cat({stats[kShare], at::zeros({1}, stats.options())}).amax()
                                         : at::zeros({}, stats.options());
  return {baseline, adv, share};
}

}  // namespace
}  // namespace vcpo
