"""A second, deliberately naive statement of docs/contract.md: Python loops over sequences and tokens with
the `math` module in float64, and the gradient derived by hand rather than by autograd. It checks the
reference backend, which in turn checks every other backend. Not log-space: use moderate inputs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from vcpo_kernels import PolicyLossOptions


@dataclass
class Seq:
    lp: list  # current log-probs of the counted tokens only
    mu: list
    old: Optional[list]
    reward: float
    group: int
    grad_sq: float
    advantage: Optional[float] = None  # caller-supplied


def _coef(lw: float, o: PolicyLossOptions):
    c_hi, c_lo = o.is_threshold, o.threshold_low
    w = math.exp(lw)
    if o.is_correction == "truncate":
        return min(w, c_hi), w > c_hi
    if o.is_correction == "mask":
        kept = c_lo <= w <= c_hi
        return (1.0 if kept else 0.0), not kept
    return 1.0, False


def _surrogate(r: float, a: float, o: PolicyLossOptions):
    """(p, dp/dr, on_clip) per the contract's branch rules."""
    p, dp, on_clip = -a * r, -a, False
    if o.clip_ratio is not None:
        lo, hi = 1 - o.clip_ratio[0], 1 + o.clip_ratio[1]
        p2 = -a * min(max(r, lo), hi)
        if not p >= p2:
            p, dp, on_clip = p2, 0.0, True
        if o.clip_ratio_c is not None and a < 0 and not p <= -a * o.clip_ratio_c:
            p, dp, on_clip = -a * o.clip_ratio_c, 0.0, True
    return p, dp, on_clip


def _token_surrogates(q: Seq, prox: list, a: float, coefs: list, o: PolicyLossOptions) -> list:
    """(p, dp/dlp, acted) of each token of one sequence: the contract's table of trust regions, token by token."""
    rule = o.trust_rule
    if q.old is None and rule == "none":  # bypass: r = 1 with dr/dlp = 1
        return [_surrogate(1.0, a, o) for _ in q.lp]
    anchor = q.old if q.old is not None else q.mu
    kept = [c != 0 and not (rule in ("cispo", "dppo_tv") and lp == -math.inf) for c, lp in zip(coefs, q.lp)]
    deltas = [lp - x for lp, x in zip(q.lp, anchor)]
    out = []
    if rule in ("none", "ppo"):
        for d in deltas:
            r = math.exp(d)
            p, dp, acted = _surrogate(r, a, o)
            out.append((p, dp * r, acted))
        return out
    kept_deltas = [d for d, k in zip(deltas, kept) if k]
    if rule == "gspo":
        rho = math.exp(sum(kept_deltas) / max(len(kept_deltas), 1))
        for _ in deltas:  # the token form: d rho / d lp_t = rho
            p, dp, acted = _surrogate(rho, a, o)
            out.append((p, dp * rho, acted))
        return out
    lo, hi = (o.clip_ratio or (0.0, 0.0))
    if rule == "gmpo":
        clip = [min(d, hi) if a > 0 else max(d, -lo) if a < 0 else d for d in deltas]
        kept_clip = [x for x, k in zip(clip, kept) if k]
        big_r = math.exp(sum(kept_clip) / max(len(kept_clip), 1))
        return [(-a * big_r, -a * big_r if x == d else 0.0, x != d) for x, d in zip(clip, deltas)]
    if rule == "sapo":
        tau = o.sapo_tau[0] if a > 0 else o.sapo_tau[1]
        for d in deltas:
            r = math.exp(d)
            sig = 1 / (1 + math.exp(-tau * (r - 1)))
            out.append((-a * 4 / tau * sig, -a * 4 * sig * (1 - sig) * r, False))
        return out
    for lp, x, d, k in zip(q.lp, anchor, deltas, kept):
        if not k:
            out.append((0.0, 0.0, False))
            continue
        r = math.exp(d)
        if rule == "cispo":
            w = min(max(r, 1 - lo), 1 + hi)
            out.append((-a * w * lp, -a * w, w != r))
        else:  # dppo_tv
            moved = math.exp(lp) - math.exp(x)
            inside = moved <= hi if a > 0 else moved >= -lo
            w = (min(r, o.clip_ratio_c) if o.clip_ratio_c is not None else r) if inside else 0.0
            out.append((-a * w * lp, -a * w, not inside))
    return out


def _mean(xs):
    return sum(xs) / len(xs)


def _weighted_quantile(rs, ws, q):
    """Walk the rewards in ascending order: the first whose running weight reaches q times the total."""
    pairs = sorted(zip(rs, ws))
    total, run = sum(ws), 0.0
    for r, w in pairs:
        run += w
        if run >= q * total:
            return r
    return pairs[-1][0]


def _robust_baseline(rs, ws, o: PolicyLossOptions):
    if sum(ws) == 0:
        ws = [1.0] * len(ws)
    if o.opob_aggregation == "median":
        return _weighted_quantile(rs, ws, 0.5)
    lo, hi = (_weighted_quantile(rs, ws, q) for q in o.opob_winsorize_quantiles)
    return sum(w * min(max(r, lo), hi) for r, w in zip(rs, ws)) / sum(ws)


def second_moment_threshold(all_deltas: list, bound: float) -> float:
    """M2PO by brute force: remove the largest Delta^2 one at a time until the mean of the rest is at most `bound`
    (an empty rest: 0); the last value removed (+inf if none). NaN values are not in the order."""
    values = sorted((d * d for d in all_deltas if not math.isnan(d * d)), reverse=True)
    for k in range(len(values) + 1):
        rest = values[k:]
        if (sum(rest) / len(rest) if rest else 0.0) <= bound:
            return values[k - 1] if k else math.inf
    raise AssertionError("unreachable: the empty rest has mean 0")


def _rejected(deltas: list, o: PolicyLossOptions, m2_threshold: float = math.inf) -> list:
    """Per token of one sequence: whether a rejection criterion removes it (`m2_threshold`: the batch's, for
    batch_m2)."""
    out = [False] * len(deltas)
    for name, low, high in o.rejection:
        scope, kind = name.rsplit("_", 1)
        if scope == "batch":
            for t, d in enumerate(deltas):
                out[t] = out[t] or not d * d < m2_threshold
            continue
        stats = [{"k1": d, "k2": d * d / 2, "k3": math.exp(d) - 1 - d}[kind] for d in deltas]
        if scope != "token":
            seq_stat = {"seq_sum": sum(stats), "seq_mean": sum(stats) / max(len(stats), 1),
                        "seq_max": max(stats, default=0.0)}[scope]
            stats = [seq_stat] * len(deltas)
        for t, x in enumerate(stats):
            kept = low <= math.exp(x) <= high if kind == "k1" else x <= high
            out[t] = out[t] or not kept
    return out


def _advantages(seqs: list[Seq], valid: list[int], s: list[float], o: PolicyLossOptions, num_groups: int):
    b = len(seqs)
    adv = [0.0] * b
    baseline = [0.0] * num_groups
    if any(q.advantage is not None for q in seqs):
        for i in valid:
            adv[i] = seqs[i].advantage
        return baseline, adv, 0.0
    batch_opob = o.advantage == "opob" and o.opob_scope == "batch"
    group_of = (lambda i: 0) if batch_opob else (lambda i: seqs[i].group)
    n_groups = 1 if batch_opob else num_groups
    baseline = [0.0] * n_groups
    shares = [0.0]  # the largest OPOB weight share of each group with members (0 with no group)
    members = {g: [i for i in valid if group_of(i) == g] for g in range(n_groups)}
    all_r = [seqs[i].reward for i in valid]
    for g, idx in members.items():
        if not idx:
            continue
        rs = [seqs[i].reward for i in idx]
        n, m = len(rs), _mean(rs)
        pop_std = math.sqrt(_mean([(x - m) ** 2 for x in rs]))
        if o.advantage == "opob":
            log_c = math.log(o.is_threshold)
            weights = []
            for i in idx:
                lw = s[i]
                if o.opob_truncated_weights:
                    lw = min(s[i], log_c)
                if o.reference_compat:
                    lw = s[i] + min(s[i], log_c)
                w = math.exp(2 * lw) * seqs[i].grad_sq
                if o.opob_length_norm:
                    w /= len(seqs[i].lp) ** 2
                weights.append(w)
            # The contract's centred form of sum W R / sum W: exact (A = 0) for constant-reward groups.
            b_g = m + sum(w * (x - m) for w, x in zip(weights, rs)) / sum(weights) if sum(weights) > 0 else m
            if o.opob_aggregation != "mean":
                b_g = _robust_baseline(rs, weights, o)
            baseline[g] = b_g
            shares.append(max(weights) / sum(weights) if sum(weights) > 0 else 1 / n)
            for k, i in enumerate(idx):
                a = seqs[i].reward - (leave_one_out_baseline(rs, weights, k) if o.opob_leave_one_out else b_g)
                adv[i] = a / pop_std if o.norm_by_std and pop_std > 1e-8 else a
        elif o.advantage == "grpo":
            baseline[g] = m
            unbiased = math.sqrt(sum((x - m) ** 2 for x in rs) / (n - 1)) if n > 1 else 0.0
            for i in idx:
                a = seqs[i].reward - m
                adv[i] = a / (unbiased + 1e-6) if o.norm_by_std else a
        elif o.advantage == "rloo":
            baseline[g] = m
            for i in idx:
                adv[i] = seqs[i].reward - (sum(rs) - seqs[i].reward) / (n - 1) if n > 1 else 0.0
        elif o.advantage == "reinforce":
            baseline[g] = _mean(all_r)
            for i in idx:
                adv[i] = seqs[i].reward - _mean(all_r)
        else:
            for i in idx:
                adv[i] = seqs[i].reward
    if o.advantage == "reinforce":
        baseline = [_mean(all_r) if all_r else 0.0] * n_groups
    return baseline, adv, max(shares)


def leave_one_out_baseline(rs: list, ws: list, i: int) -> float:
    """b_-i by brute force: the weighted mean of the others' rewards; their plain mean if every other weight is 0;
    R_i itself (advantage 0) with no other member."""
    others = [j for j in range(len(rs)) if j != i]
    if not others:
        return rs[i]
    total = sum(ws[j] for j in others)
    if total == 0:
        return sum(rs[j] for j in others) / len(others)
    return sum(ws[j] * rs[j] for j in others) / total


def oracle(seqs: list[Seq], o: PolicyLossOptions, num_groups: int, norm_length: Optional[float] = None) -> dict:
    """Loss, d loss / d lp of each counted token, and the statistics."""
    b = len(seqs)
    prox = [q.old if q.old is not None else q.lp for q in seqs]
    deltas = [[p - m for p, m in zip(prox[i], seqs[i].mu)] for i in range(b)]
    s = [sum(d) for d in deltas]
    lengths = [len(q.lp) for q in seqs]
    valid = [i for i in range(b) if lengths[i] > 0]
    n_tok = sum(lengths)
    n_seq = len(valid)

    ws = [math.exp(min(s[i], math.log(o.is_threshold)) if o.ess_on_corrected else s[i]) for i in valid]
    ess = sum(ws) ** 2 / sum(w * w for w in ws) if ws else 0.0
    ratio = ess / n_seq if n_seq else 0.0
    x = min(1.0, ratio / o.ess_base_ratio)
    lr_scale = {"sqrt": math.sqrt(x), "linear": x, None: 1.0}[o.lr_rule]

    baseline, adv, max_share = _advantages(seqs, valid, s, o, num_groups)

    bound = o.second_moment_bound
    m2_threshold = math.inf if bound is None else second_moment_threshold([d for dl in deltas for d in dl], bound)
    loss, grads = 0.0, [[0.0] * lengths[i] for i in range(b)]
    changed = coef_sum = clipped = rejected = 0.0
    for i in valid:
        agg = {
            "token-mean": 1 / n_tok,
            "seq-mean-token-mean": 1 / (n_seq * lengths[i]),
            "seq-mean-token-sum": 1 / n_seq,
            "seq-mean-token-sum-norm": 1 / (n_seq * (norm_length or 1.0)),
        }[o.loss_agg_mode]
        if o.is_level != "token":
            lw = s[i] / lengths[i] if o.is_level == "geometric" else s[i]
            c_seq, ch = _coef(lw, o)
            changed += ch
            coef_sum += c_seq
        rejects = _rejected(deltas[i], o, m2_threshold)
        rejected += sum(rejects)
        coefs = []
        for t in range(lengths[i]):
            if o.is_level == "token":
                c, ch = _coef(deltas[i][t], o)
                changed += ch
                coef_sum += c
            else:
                c = c_seq
            coefs.append(0.0 if rejects[t] else c)
        for t, (p, dp, on_clip) in enumerate(_token_surrogates(seqs[i], prox[i], adv[i], coefs, o)):
            clipped += on_clip and coefs[t] != 0  # a unit with coefficient 0 takes no branch (its r is not read)
            loss += agg * coefs[t] * p
            grads[i][t] = agg * coefs[t] * dp
    units = n_tok if o.is_level == "token" else n_seq
    mean_coef = coef_sum / units if units else 0.0
    if o.is_batch_normalize and mean_coef > 0:
        loss /= mean_coef
        grads = [[g / mean_coef for g in gs] for gs in grads]
    k3 = sum(math.expm1(d) - d for dl in deltas for d in dl)
    return {
        "loss": loss,
        "grads": grads,
        "ess": ess,
        "ess_ratio": ratio,
        "lr_scale": lr_scale,
        "baseline": baseline,
        "advantages": adv,
        "seq_log_weight": s,
        "is_clip_fraction": changed / units if units else 0.0,
        "mean_is_coef": mean_coef,
        "kl_k3": k3 / n_tok if n_tok else 0.0,
        "num_tokens": float(n_tok),
        "num_seqs": float(n_seq),
        "ppo_clip_fraction": clipped / n_tok if n_tok else 0.0,
        "rejected_fraction": rejected / n_tok if n_tok else 0.0,
        "opob_max_share": max_share,
    }
