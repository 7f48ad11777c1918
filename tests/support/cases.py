"""Option sets every backend is checked under (names are the pytest ids)."""

OPTION_CASES = {
    "default": {},
    "token-truncate": dict(is_level="token"),
    "token-mask": dict(is_level="token", is_correction="mask", is_threshold=1.3),
    "geometric-truncate": dict(is_level="geometric", is_threshold=1.05),
    "seq-mask": dict(is_correction="mask", is_threshold=2.0, is_threshold_low=0.7),
    "seq-none": dict(is_correction="none"),
    "seq-truncate-low-C": dict(is_threshold=1.2),
    "ess-corrected": dict(ess_on_corrected=True, is_threshold=1.5),
    "lr-linear-base": dict(lr_rule="linear", ess_base_ratio=0.55),
    "lr-none": dict(lr_rule=None),
    "opob-no-std": dict(norm_by_std=False),
    "opob-batch": dict(opob_scope="batch"),
    "opob-length-norm": dict(opob_length_norm=True),
    "opob-truncated": dict(opob_truncated_weights=True, is_threshold=1.5),
    "opob-compat": dict(reference_compat=True, is_threshold=1.5),
    "opob-loo": dict(opob_leave_one_out=True),
    "opob-loo-batch": dict(opob_leave_one_out=True, opob_scope="batch"),
    "grpo": dict(advantage="grpo"),
    "grpo-no-std": dict(advantage="grpo", norm_by_std=False),
    "rloo": dict(advantage="rloo"),
    "reinforce": dict(advantage="reinforce"),
    "none": dict(advantage="none"),
    # Trust regions: in bypass mode they read pi / mu, which carries the importance weight, so there they run with
    # a correction that does not reweight (none, mask); with old_logp any correction.
    "ppo-clip": dict(clip_ratio=(0.2, 0.28), is_correction="none"),
    "ppo-clip-truncate": dict(clip_ratio=(0.2, 0.28)),
    "ppo-dual-clip": dict(clip_ratio=(0.1, 0.1), clip_ratio_c=1.5, is_correction="mask", is_threshold=2.0),
    "gspo": dict(trust_region="gspo", clip_ratio=(0.03, 0.04), is_correction="none"),
    "gspo-dual-token-mask": dict(trust_region="gspo", clip_ratio=(0.03, 0.04), clip_ratio_c=1.05, is_level="token",
                                 is_correction="mask", is_threshold=1.3),
    "gmpo": dict(trust_region="gmpo", clip_ratio=(0.1, 0.15), is_correction="none"),
    "gmpo-token-mask": dict(trust_region="gmpo", clip_ratio=(0.1, 0.15), is_level="token", is_correction="mask",
                            is_threshold=1.3),
    "cispo": dict(trust_region="cispo", clip_ratio=(0.1, 0.2), is_correction="none"),
    "cispo-upper-only": dict(trust_region="cispo", clip_ratio=(10.0, 0.1), is_correction="none"),
    "dppo-tv": dict(trust_region="dppo_tv", clip_ratio=(0.02, 0.03), is_correction="none"),
    "dppo-tv-capped": dict(trust_region="dppo_tv", clip_ratio=(0.02, 0.03), clip_ratio_c=1.1, is_correction="mask",
                           is_level="token", is_threshold=1.3),
    "sapo": dict(trust_region="sapo", is_correction="none"),
    "sapo-tau-seq-mask": dict(trust_region="sapo", sapo_tau=(0.5, 3.0), is_correction="mask", is_threshold=1.5),
    "agg-token-mean": dict(loss_agg_mode="token-mean"),
    "agg-seq-token-sum": dict(loss_agg_mode="seq-mean-token-sum"),
    "agg-seq-token-sum-norm": dict(loss_agg_mode="seq-mean-token-sum-norm", norm_length=16.0),
}
# Cases whose loss depends on a recomputed proximal policy: run them with old_logp as well.
WITH_OLD = {"default", "token-truncate", "token-mask", "ppo-clip", "ppo-dual-clip", "geometric-truncate", "gspo",
            "gspo-dual-token-mask", "gmpo", "gmpo-token-mask", "cispo", "cispo-upper-only", "dppo-tv",
            "dppo-tv-capped", "sapo", "sapo-tau-seq-mask"}
# Cases refused in bypass mode (a trust region with the truncating correction): run with old_logp only.
ONLY_OLD = {"ppo-clip-truncate"}


def case_runs(name: str) -> list[bool]:
    """The with_old values case `name` runs with."""
    if name in ONLY_OLD:
        return [True]
    return [False, True] if name in WITH_OLD else [False]

# Rejection criteria and OPOB's robust aggregations, each family once, for the GPU backends
# (tests/kernels/test_robust_baselines_rejection_normalisation.py holds the CPU ones to more); run with old_logp as well.
GPU_EXTRA_CASES = {
    "median": dict(opob_aggregation="median"),
    "winsorized-narrow": dict(opob_aggregation="winsorized_mean", opob_winsorize_quantiles=(0.3, 0.6)),
    "reject-token-k1-k3": dict(rejection=(("token_k1", 0.7, 1.5), ("token_k3", None, 0.1)), is_level="token"),
    "reject-seq-sum-mean-max": dict(rejection=(("seq_sum_k1", 0.3, 3.0), ("seq_mean_k2", None, 0.1),
                                               ("seq_max_k3", None, 0.3))),
    "reject-m2-gspo": dict(rejection=(("batch_m2", None, 0.05),), trust_region="gspo", clip_ratio=(0.03, 0.04),
                           is_correction="none"),
}
