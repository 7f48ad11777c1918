"""vcpo.integrations.trl.VCPOAsyncGRPOTrainer against the real trl.experimental.async_grpo.AsyncGRPOTrainer on the
CPU: its training loop, rollout queue, batcher, tree packing, collator, fused log-prob head and callbacks, with
stand-ins for what needs a GPU or a vLLM server: an in-process rollout worker (TRL's `rollout_worker` protocol) that
queues fixed scored samples, a no-op weight transfer, a varlen causal attention in torch for the FlashAttention-3 hub
kernel that TRL's tree attention calls, and a constant for the CUDA peak FLOPs of TRL's MFU metric. Checked against
float64 references on the unpacked samples, and against TRL's own loss. One opt-in test (VCPO_TEST_VLLM_SERVER=1)
runs TRL's own rollout worker against a CPU vLLM server instead of the first two."""

import copy
import os
import queue

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback
import trl.experimental.async_grpo.packing as packing
import trl.experimental.async_grpo.async_grpo_trainer as async_grpo_trainer
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout, FixedCountBatcher
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

import vcpo
from vcpo import VCPOConfig
from vcpo.integrations.trl import VCPOAsyncGRPOConfig, VCPOAsyncGRPOTrainer, _WithGroups
from vcpo.trainer.tiny import TinyRecipe, build_model, build_tokenizer

from support.trl_callbacks import Recorder  # the lr inside and after each optimizer step

N_GEN = 4
TEMPERATURE = 0.9
PROMPTS = ["1+2=", "3+4=", "5+6=", "7+8=", "9+1=", "2+2=", "4+4=", "6+1="]


class _TorchVarlen:
    """flash_attn_varlen_func in torch: segment s's queries attend causally (bottom-right aligned, as FlashAttention
    with seqlen_q <= seqlen_k) to its gathered keys."""

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True,
                               window_size=(-1, -1), **kwargs):
        assert causal and tuple(window_size) == (-1, -1)
        out = []
        for s in range(len(cu_q) - 1):
            qs, ks, vs = q[cu_q[s]:cu_q[s + 1]], k[cu_k[s]:cu_k[s + 1]], v[cu_k[s]:cu_k[s + 1]]
            lq, lk = len(qs), len(ks)
            allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
            out.append(torch.nn.functional.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=allowed,
                scale=softmax_scale).transpose(0, 1))
        return torch.cat(out)


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
    monkeypatch.setattr(packing, "_flash_attn", lambda: _TorchVarlen)
    # TRL's MFU metric reads the CUDA device's name for its peak FLOPs.
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda accelerator, dtype: 1.0)


class FixedRollouts:
    """TRL's rollout-worker protocol, in process: `start` queues the given samples."""

    def __init__(self, samples):
        self.samples = samples
        self.rollout_buffer, self.metrics_queue = queue.Queue(), queue.Queue()

    def start(self):
        for sample in self.samples:
            self.rollout_buffer.put(sample)

    def stop(self):
        pass

    def update_model_version(self, model_version):
        pass

    def check_health(self, stale_after_s):
        raise RuntimeError("the test's rollout queue ran dry")


class NoWeightSync:
    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        for _ in iterator:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer()
    tok.padding_side = "left"
    return tok


@pytest.fixture
def model_dir(tokenizer, tmp_path):
    model = build_model(TinyRecipe(hidden_size=32, num_heads=2, intermediate_size=64, num_layers=1), len(tokenizer))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model"), model


def sample_logp(model, ids):
    """float64 log-probs of ids[1:] under `model` at the sampling temperature, [len(ids) - 1]."""
    logits = model(input_ids=torch.as_tensor(ids)[None], use_cache=False).logits[0, :-1].double()
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, torch.as_tensor(ids)[1:, None]).squeeze(-1)


def make_samples(tokenizer, behaviour, num_groups, seed=0):
    """Scored samples as TRL's rollout worker queues them: random completions of 2-6 tokens, the reward of
    tests/integrations/test_trl.py's toy function, `behaviour`'s log-probs as old_log_probs (0 on the prompt), TRL's
    own group-normalised advantage, group by group."""
    rng = torch.Generator().manual_seed(seed)
    samples = []
    for g in range(num_groups):
        prompt = tokenizer(PROMPTS[g % len(PROMPTS)])["input_ids"]
        rows = []
        for _ in range(N_GEN):
            completion = torch.randint(4, len(tokenizer), (int(torch.randint(2, 7, (), generator=rng)),),
                                       generator=rng).tolist()
            ids = prompt + completion
            with torch.no_grad():
                logp = sample_logp(behaviour, ids)
            old = np.zeros(len(ids), dtype=np.float32)
            old[len(prompt):] = logp[len(prompt) - 1:].numpy()
            rows.append((ids, len(prompt), old, float(sum(t % 3 == 0 for t in completion))))
        rewards = np.array([r[3] for r in rows])
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
        for (ids, p, old, reward), advantage in zip(rows, advantages):
            samples.append(RolloutSample(
                prompt=[], completion=[], input_ids=np.array(ids),
                completion_mask=np.array([0] * p + [1] * (len(ids) - p)),
                old_log_probs=old, advantage=float(advantage), model_version=0, group_id=g,
                metrics={"reward": reward}))
    return samples


def micro_batch(tokenizer, samples, size):
    """The first micro-batch of `size` samples through TRL's batcher and collator (and VCPO's groups), as
    RolloutQueueDataset yields the samples."""
    source = iter({"input_ids": s.input_ids, "completion_mask": s.completion_mask, "old_log_probs": s.old_log_probs,
                   "advantage": s.advantage, "group_id": s.group_id, "metrics": s.metrics} for s in samples)
    rows = next(iter(FixedCountBatcher(source, num_processes=1, microbatch_size=size)))
    return _WithGroups(DataCollatorForRollout(tokenizer.pad_token_id))([rows])


def perturbed(model, scale=4.0):
    torch.manual_seed(1)
    copy_ = type(model)(model.config)
    copy_.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in copy_.parameters():
            p.add_(scale * p.std().nan_to_num(0) * torch.randn_like(p))
    return copy_


def make(cls, path, tokenizer, samples, **overrides):
    kw = dict(output_dir="/tmp/vcpo-trl-async-test", per_device_train_batch_size=2 * N_GEN, num_generations=N_GEN,
              gradient_accumulation_steps=2, max_steps=2, learning_rate=0.5, optim="sgd", token_budget=0,
              temperature=TEMPERATURE, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
              seed=0, disable_tqdm=True)
    kw.update(overrides)
    # AsyncGRPOTrainer ignores vcpo_config. The dataset is the worker's, which this test replaces.
    return cls(model=path, reward_funcs=[], args=VCPOAsyncGRPOConfig(**kw),
               train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
               rollout_worker=FixedRollouts(samples), weight_transfer=NoWeightSync())


def snapshot(model):
    """A float64 copy in a fresh model with plain attention (no tree packing, no fused head)."""
    config = copy.deepcopy(model.config)
    config._attn_implementation = "eager"
    copy_ = type(model)(config)
    copy_.load_state_dict(model.state_dict())
    return copy_.double()


def reference(policy, rows, config):
    """A micro-batch's samples (in the packed row's order), unpacked, through vcpo.policy_loss in float64: the prompt
    groups are the micro-batch's, G_i the trained length."""
    logps, behaviours, rewards, groups = [], [], [], []
    for s in rows:
        p = int((s["completion_mask"] == 0).sum())
        logps.append(sample_logp(policy, s["input_ids"].tolist())[p - 1:])
        behaviours.append(torch.as_tensor(s["old_log_probs"][p:], dtype=torch.float64))
        rewards.append(s["metrics"]["reward"])
        groups.append(s["group_id"])
    width = max(len(x) for x in logps)
    pad = lambda xs: torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in xs])  # noqa: E731
    mask = pad([torch.ones(len(x)) for x in logps]).bool()
    ids, group_index = torch.unique(torch.tensor(groups), return_inverse=True)
    logp, behaviour = pad(logps), pad(behaviours)
    res = vcpo.policy_loss(logp.detach(), behaviour, config=config.replace(backend="torch"), mask=mask,
                           rewards=torch.tensor(rewards, dtype=torch.float64), group_index=group_index,
                           num_groups=len(ids), grad_sq_norm=mask.sum(1).double())
    log_w = torch.where(mask, logp - behaviour, 0).sum(1).detach()
    return res, log_w


def test_trains_and_matches_policy_loss(tokenizer, model_dir, monkeypatch):
    """Two optimizer steps of two micro-batches of two whole prompt groups each, off-policy samples: each micro-batch's
    loss, OPOB baselines and ESS against float64 vcpo.policy_loss on its unpacked samples; each step's lr is the
    base lr times the (linear, the default) lr scale of the ESS of its 16 sequences, restored after the step."""
    path, model = model_dir
    samples = make_samples(tokenizer, perturbed(model), num_groups=12)  # 8, and the micro-batch accelerate prefetches
    trainer = make(VCPOAsyncGRPOTrainer, path, tokenizer, samples)
    lr = Recorder()
    trainer.add_callback(lr)
    rows, calls = [], []
    collate = _WithGroups.__call__
    monkeypatch.setattr(_WithGroups, "__call__", lambda self, examples: rows.append(examples[0][0].samples)
                        or collate(self, examples))
    compute_loss = trainer.compute_loss

    def recorded(model, inputs, **kw):
        policy = snapshot(trainer.accelerator.unwrap_model(model))
        loss = compute_loss(model, inputs, **kw)
        calls.append((float(loss), policy, {k: v[-1] for k, v in trainer._metrics["train"].items() if v}))
        return loss

    trainer.compute_loss = recorded
    start = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()

    assert len(calls) == 4 and len(lr.scaled) == 2
    assert any(not torch.equal(a, p) for a, p in zip(start, trainer.model.parameters()))
    config = trainer.vcpo_config
    step_log_w = [[], []]
    for k, (loss, policy, metrics) in enumerate(calls):
        assert len(rows[k]) == 2 * N_GEN
        res, log_w = reference(policy, rows[k], config)
        step_log_w[k // 2].append(log_w)
        assert loss * 2 == pytest.approx(float(res.loss), rel=1e-4, abs=1e-6)  # 2 micro-batches per step
        assert metrics["vcpo/micro_batch_ess_ratio"] == pytest.approx(float(res.ess_ratio), rel=1e-4)
        assert metrics["vcpo/baseline_mean"] == pytest.approx(float(res.baseline.mean()), rel=1e-4, abs=1e-5)
    logs = [h for h in trainer.state.log_history if "vcpo/lr_scale" in h]
    assert len(logs) == 2
    for log_w, scaled, base, after, log in zip(step_log_w, lr.scaled, lr.base, lr.after, logs):
        w = torch.cat(log_w).exp()
        rho = float(w.sum() ** 2 / (len(w) * (w ** 2).sum()))
        assert 0.05 < rho < 0.95  # off-policy: the lr scale is not the trivial 1
        assert log["vcpo/ess_ratio"] == pytest.approx(rho, rel=1e-4)
        assert scaled == pytest.approx(base * min(1.0, rho), rel=1e-4) and after == base


class _Steps(TrainerCallback):
    """The weights and the optimizer's state after each optimizer step."""

    def __init__(self):
        self.after = []

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.after.append(([p.detach().clone() for p in model.parameters()], copy.deepcopy(optimizer.state_dict())))


def test_a_step_with_a_nonfinite_behaviour_logprob_is_skipped_whole(tokenizer, model_dir, monkeypatch):
    """One sample of the first optimizer step's micro-batches has a behaviour log-prob of -inf (its ESS is NaN): that
    step is skipped, as vcpo.step skips one (the weights as they were, bitwise), and the next one is taken; logged
    vcpo/skipped 1 then 0."""
    path, model = model_dir
    samples = make_samples(tokenizer, perturbed(model), num_groups=12)
    first = samples[0]
    first.old_log_probs[int(np.argmax(first.completion_mask))] = -np.inf
    trainer = make(VCPOAsyncGRPOTrainer, path, tokenizer, samples, optim="adamw_torch", learning_rate=1e-2)
    steps = _Steps()
    trainer.add_callback(steps)
    start = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    (first, state1), (second, state2) = steps.after
    assert all(torch.equal(a, b) for a, b in zip(first, start)) and state1["state"] == {}
    assert any(not torch.equal(a, b) for a, b in zip(second, start))
    assert {int(s["step"]) for s in state2["state"].values()} == {1}
    assert [h["vcpo/skipped"] for h in trainer.state.log_history if "vcpo/skipped" in h] == [1.0, 0.0]


def test_on_policy_gradient_equals_async_grpo_trainer(tokenizer, model_dir):
    """On-policy samples (old_log_probs = the policy's), no IS correction, group-mean advantages over whole groups
    (TRL's worker's advantages without its std, given to both), token-mean, PPO clip out of reach: VCPO's gradient on
    a micro-batch equals AsyncGRPOTrainer's own compute_loss."""
    path, model = model_dir
    samples = make_samples(tokenizer, model, num_groups=2)
    for s in samples:  # TRL's worker divides by the group's std; VCPO's grpo without std does not
        group = [x.metrics["reward"] for x in samples if x.group_id == s.group_id]
        s.advantage = s.metrics["reward"] - sum(group) / len(group)
    off = VCPOConfig(is_correction="none", advantage="grpo", norm_by_std=False, lr_rule=None,
                     loss_agg_mode="token-mean", grad_norms="uniform")
    grads = []
    for cls in (AsyncGRPOTrainer, VCPOAsyncGRPOTrainer):
        trainer = make(cls, path, tokenizer, samples, vcpo_config=off, gradient_accumulation_steps=1, epsilon=1e6)
        trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which this test skips
        batch = micro_batch(tokenizer, samples, 2 * N_GEN)
        trainer.model.zero_grad()
        trainer.compute_loss(trainer.model, batch).backward()
        grads.append([p.grad.clone() for p in trainer.model.parameters()])
    assert sum(float(g.abs().sum()) for g in grads[0]) > 0
    for g_trl, g_vcpo in zip(*grads):
        torch.testing.assert_close(g_vcpo, g_trl, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("overrides, words", [
    ({"vcpo_config": VCPOConfig()}, "grad_norms='exact'"),
    ({"vcpo_config": VCPOConfig(grad_norms="length", opob_scope="batch")}, "opob_scope"),
])
def test_unsupported_options_are_refused(tokenizer, model_dir, overrides, words):
    with pytest.raises(ValueError, match=words):
        make(VCPOAsyncGRPOTrainer, model_dir[0], tokenizer, [], **overrides)


@pytest.mark.parametrize("microbatch_size, unscorable, words", [
    (N_GEN + 2, False, r"prompt groups \[1\] have only \[2\]"),  # one group and half of the next
    (2 * N_GEN, True, "1 samples have no reward"),
])
def test_split_group_and_unscorable_sample_are_refused(tokenizer, model_dir, microbatch_size, unscorable, words):
    path, model = model_dir
    samples = make_samples(tokenizer, model, num_groups=2)
    if unscorable:
        samples[3].metrics["reward"] = float("nan")  # how TRL's worker marks a sample no reward function scored
    trainer = make(VCPOAsyncGRPOTrainer, path, tokenizer, samples)
    batch = micro_batch(tokenizer, samples, microbatch_size)
    with pytest.raises(ValueError, match=words):
        trainer.compute_loss(trainer.model, batch)


def reward(completions, completion_ids, **kwargs):
    """The toy reward, at module level: TRL's rollout worker pickles it into its child process."""
    return [float(sum(1 for t in ids if t % 3 == 0)) for ids in completion_ids]


class ReloadOverHttp:
    """TRL's weight-transfer protocol over vLLM's /collective_rpc reload_weights (its own is NCCL only)."""

    def __init__(self, url, folder):
        self.url, self.folder = url, folder

    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        import httpx
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous() for k, v in iterator}, f"{self.folder}/model.safetensors")
        httpx.post(f"{self.url}/collective_rpc", json={"method": "reload_weights", "kwargs": {
            "weights_path": self.folder}}, timeout=60).raise_for_status()

    def resume(self):
        pass

    def destroy(self):
        pass


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("VCPO_TEST_VLLM_SERVER") != "1",
                    reason="about 2.5 minutes (a vLLM server): set VCPO_TEST_VLLM_SERVER=1")
def test_real_rollout_worker_and_vllm_server(tokenizer, tmp_path, monkeypatch):
    """TRL's own AsyncRolloutWorker (a child process) sampling from a CPU vLLM server (`vcpo serve`), with the weights
    reloaded into the server after every step: the first step is on-policy (vLLM's log-probs are the trainer's, ESS 1),
    later ones train on samples one policy version old (ESS below 1), every micro-batch's loss equals the float64
    reference on its samples, and each step runs at the lr scale of its ESS."""
    from vcpo.trainer.engines.servers import LocalServers

    tok = copy.copy(tokenizer)  # a conversational template and its response parser, which TRL's worker needs
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.response_template = {"defaults": {"role": "assistant"}, "start_anchor_pattern": "^",
                             "fields": {"content": {"content": "text"}}}
    model = build_model(TinyRecipe(hidden_size=64, num_heads=2, intermediate_size=128, num_layers=1), len(tok))
    model.save_pretrained(tmp_path / "model")  # vLLM's CPU attention needs head_dim >= 32
    tok.save_pretrained(tmp_path / "model")
    (tmp_path / "sync").mkdir()
    servers = LocalServers(str(tmp_path / "model"), 1, log_dir=str(tmp_path / "logs"), dtype="float32",
                           max_model_len=64, kv_cache_gib=1, seed=0)
    url = servers.start()[0]
    rows, calls = [], []
    collate = _WithGroups.__call__
    monkeypatch.setattr(_WithGroups, "__call__", lambda self, examples: rows.append(examples[0][0].samples)
                        or collate(self, examples))
    try:
        args = VCPOAsyncGRPOConfig(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=2 * N_GEN, num_generations=N_GEN,
            gradient_accumulation_steps=2, max_steps=3, learning_rate=0.5, optim="sgd", token_budget=0,
            max_completion_length=8, temperature=TEMPERATURE, max_staleness=1, logging_steps=1, report_to=[],
            save_strategy="no", use_cpu=True, bf16=False, seed=0, disable_tqdm=True, vllm_server_base_url=url)
        data = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS * 4]})
        trainer = VCPOAsyncGRPOTrainer(model=str(tmp_path / "model"), reward_funcs=reward, args=args,
                                       train_dataset=data, processing_class=tok,
                                       weight_transfer=ReloadOverHttp(url, str(tmp_path / "sync")))
        lr = Recorder()
        trainer.add_callback(lr)
        compute_loss = trainer.compute_loss

        def recorded(model, inputs, **kw):
            policy = snapshot(trainer.accelerator.unwrap_model(model))
            loss = compute_loss(model, inputs, **kw)
            calls.append((float(loss), policy))
            return loss

        trainer.compute_loss = recorded
        trainer.train()
    finally:
        servers.stop()
    logs = [h for h in trainer.state.log_history if "vcpo/lr_scale" in h]
    assert len(logs) == 3 and len(lr.scaled) == 3
    assert logs[0]["vcpo/ess_ratio"] == pytest.approx(1.0, abs=1e-4)  # vLLM's log-probs of the synced weights
    assert logs[-1]["sample/staleness_mean"] >= 1 and logs[-1]["vcpo/ess_ratio"] < 0.99
    for log, scaled, base, after in zip(logs, lr.scaled, lr.base, lr.after):
        assert scaled == pytest.approx(base * min(1.0, log["vcpo/ess_ratio"]), rel=1e-6) and after == base
    assert len(calls) == 6
    for (loss, policy), micro_batch in zip(calls, rows):
        assert len({s["group_id"] for s in micro_batch}) == 2  # whole groups from TRL's own batcher
        res, _ = reference(policy, micro_batch, trainer.vcpo_config)
        assert loss * 2 == pytest.approx(float(res.loss), rel=1e-4, abs=1e-6)
