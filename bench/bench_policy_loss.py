"""Forward+backward benchmark of vcpo_kernels.policy_loss on CPU: eager reference vs torch.compile vs the fused
C++ op vs a plain copy of its inputs (the bandwidth floor). B = 512 x T = 2048 tokens, fp32, default options;
and the same B with one token per sequence ("latency": the fixed cost of a call). Beside them, on the padded
layout, what verl users run today where verl is installed (vcpo[verl]): "verl loss" is
`compute_policy_loss_vanilla` (PPO clipping, seq-mean-token-mean) with sequence-level truncated rollout IS
weights (C = 8) and GRPO advantages computed beforehand; "verl" also computes those weights
(`compute_rollout_correction_weights`) and advantages (`compute_grpo_outcome_advantage`) in each call, as our
fused op does its baseline. verl's is GRPO's group-mean advantage, not OPOB: a cost comparison, not the same
update. TRL is absent: its loss is a method of GRPOTrainer that runs the model's forward itself, so there is
no TRL loss to call on given log-prob tensors.

    python -m pytest bench/bench_policy_loss.py --benchmark-only
    python -m pytest bench/bench_policy_loss.py --benchmark-only --benchmark-save=NAME   # keep this run
    python -m pytest bench/bench_policy_loss.py --benchmark-only --benchmark-compare     # against the last kept

bench/conftest.py prints the ratio table (speedups and targets) after pytest-benchmark's own tables.
"""

import functools

import pytest
import torch

import vcpo_kernels

torch.set_num_threads(2)
B, T, GROUP = 512, 2048, 8
# (warmup, timed) rounds per case: enough for a stable median, about a second or two each on 2 cores.
ROUNDS = {"eager": (2, 30), "compile": (2, 40), "fused": (5, 200), "fused fwd": (5, 200), "copy floor": (5, 500),
          "verl": (2, 30), "verl loss": (2, 30)}
VERL_CASES = ("verl", "verl loss")


@functools.cache
def make_inputs(layout: str) -> dict:
    if layout == "latency":  # B sequences of one token each: the fixed cost of one call, no bandwidth
        logp = torch.randn(B, 1) * 0.3 - 1
        return dict(logp=logp, behavior_logp=logp + 0.05, mask=None, cu_seqlens=None, rewards=torch.rand(B),
                    group_index=torch.arange(B) // GROUP, num_groups=B // GROUP)
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(B, T, generator=g) * 0.3 - 1
    behavior_logp = logp + 0.05 * torch.randn(B, T, generator=g)
    prompt = torch.randint(64, 512, (B, 1), generator=g)  # first `prompt` tokens: the prompt, not counted
    response = (torch.rand(B, 1, generator=g) * (T - prompt - 32)).long() + 32  # then the response; rest: padding
    pos = torch.arange(T)
    mask = (pos >= prompt) & (pos < prompt + response)
    seq = dict(
        rewards=torch.randint(0, 2, (B,), generator=g).float(),
        group_index=torch.arange(B) // GROUP,
        num_groups=B // GROUP,
    )
    if layout == "padded":
        return dict(logp=logp, behavior_logp=behavior_logp, mask=mask, cu_seqlens=None, **seq)
    cu = torch.zeros(B + 1, dtype=torch.int64)
    cu[1:] = mask.sum(1).cumsum(0)
    return dict(logp=logp[mask].contiguous(), behavior_logp=behavior_logp[mask].contiguous(), mask=None,
                cu_seqlens=cu, **seq)


def loss_fn(backend: str):
    def run(logp, **kw):
        return vcpo_kernels.policy_loss(logp, validate=False, backend=backend, **kw).loss
    return run


@functools.cache
def compiled_loss():
    return torch.compile(loss_fn("torch"), dynamic=False)


def fwd_bwd(fn, inputs):
    kw = dict(inputs)
    logp = kw.pop("logp")

    def step():
        leaf = logp.detach().requires_grad_()  # fresh leaf: no gradient accumulation across rounds
        fn(leaf, **kw).backward()
    return step


def make_case(case: str, inputs: dict):
    if case == "eager":
        return fwd_bwd(loss_fn("torch"), inputs)
    if case == "compile":
        return fwd_bwd(compiled_loss(), inputs)
    if case == "fused":
        return fwd_bwd(loss_fn("cpu"), inputs)
    if case == "fused fwd":  # torch.ops.vcpo.policy_loss alone (plus the thin Python wrapper)
        fwd = loss_fn("cpu")

        @torch.no_grad()
        def step():
            fwd(**inputs)
        return step
    if case == "copy floor":  # read every token tensor the op reads, once: dst.copy_(src) into preallocated buffers
        pairs = [(torch.empty_like(t), t) for k in ("logp", "behavior_logp", "mask") if (t := inputs[k]) is not None]

        def step():
            for dst, src in pairs:
                dst.copy_(src)
        return step
    if case in VERL_CASES:
        return verl_step(inputs, with_weights_and_advantages=case == "verl")
    raise ValueError(case)


class _VerlActorConfig(dict):
    """The fields of verl's ActorConfig that compute_policy_loss_vanilla reads (its defaults; C for the IS)."""

    def __init__(self):
        super().__init__(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                         global_batch_info={})
        self.__dict__ = self


def verl_step(inputs: dict, with_weights_and_advantages: bool):
    core = pytest.importorskip("verl.trainer.ppo.core_algos")
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    logp, behavior, mask = inputs["logp"], inputs["behavior_logp"], inputs["mask"].float()
    index = inputs["group_index"].numpy()
    rewards = torch.zeros(B, T)
    rewards[:, -1] = inputs["rewards"]  # outcome rewards: verl sums each row
    config = _VerlActorConfig()

    def weights_and_advantages(current):
        advantages, _ = core.compute_grpo_outcome_advantage(rewards, mask, index)
        weights, _ = compute_rollout_correction_weights(current - behavior, mask, rollout_is="sequence",
                                                        rollout_is_threshold=8.0)
        return weights, advantages

    fixed = weights_and_advantages(logp)

    def step():
        leaf = logp.detach().requires_grad_()
        with torch.no_grad():
            weights, advantages = weights_and_advantages(leaf) if with_weights_and_advantages else fixed
        # bypass mode: the proximal policy is the behaviour policy
        loss, _ = core.compute_policy_loss_vanilla(behavior, leaf, advantages, mask, "seq-mean-token-mean", config,
                                                   weights)
        loss.backward()
    return step


LAYOUTS = [pytest.param(lay, id=lay, marks=pytest.mark.benchmark(group=lay)) for lay in ("padded", "packed", "latency")]


@pytest.mark.parametrize("case", list(ROUNDS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_policy_loss(benchmark, layout, case):
    if case in VERL_CASES and layout != "padded":
        pytest.skip("verl's losses take padded [B, T] tensors")
    step = make_case(case, make_inputs(layout))
    step()  # first call outside the timing (torch.compile compiles here, ~30 s once per layout)
    benchmark.extra_info.update(case=case, layout=layout)
    warmup, rounds = ROUNDS[case]
    benchmark.pedantic(step, rounds=rounds, warmup_rounds=warmup)
