"""vcpo.integrations.trl against the real trl.GRPOTrainer (CPU, use_vllm=False) on a tiny random Llama with a locally
built tokenizer: the generation batch's advantages, ESS and lr scale against float64 recomputations on the same
completions, the loss against vcpo.policy_loss, the gradient with VCPO's parts off against GRPOTrainer's own, and
baselines formed once over a generation batch that steps_per_generation splits into several optimizer steps, and two
processes under `accelerate launch` against one. Run as a script, the file is that test's training run."""

import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

import vcpo
from vcpo import VCPOConfig
from vcpo.integrations.trl import VCPOGRPOConfig, VCPOGRPOTrainer, _no_step
from vcpo.trainer.net import free_port
from vcpo.trainer.tiny import TinyRecipe, build_model, build_tokenizer
from support.trl_callbacks import Recorder

N_GEN = 4  # completions per prompt
TEMPERATURE = 0.9


def reward(completions, completion_ids, **kwargs):
    """Toy reward: how many generated ids are multiples of 3 (varied within a group)."""
    return [float(sum(1 for t in ids if t % 3 == 0)) for ids in completion_ids]


def reward_of(out):
    """The same reward from the trainer's padded batch (the ids its completion_mask counts)."""
    return torch.tensor([float(sum(1 for t, m in zip(ids.tolist(), mask.tolist()) if m and t % 3 == 0))
                         for ids, mask in zip(out["completion_ids"], out["completion_mask"])], dtype=torch.float64)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def tiny_model(tokenizer):
    return build_model(TinyRecipe(hidden_size=32, num_heads=2, intermediate_size=64, num_layers=1), len(tokenizer))


def dataset():
    return Dataset.from_dict({"prompt": ["1+2=", "3+4=", "5+6=", "7+8=", "9+1=", "2+2="] * 4})


def make(cls, tokenizer, model, config_cls=VCPOGRPOConfig, **overrides):
    kw = dict(output_dir="/tmp/vcpo-trl-test", per_device_train_batch_size=8, num_generations=N_GEN,
              max_completion_length=6, max_steps=2, learning_rate=1e-2, logging_steps=1, report_to=[],
              save_strategy="no", use_cpu=True, bf16=False, seed=0, temperature=TEMPERATURE, disable_tqdm=True)
    kw.update(overrides)
    return cls(model=model, reward_funcs=reward, args=config_cls(**kw), train_dataset=dataset(),
               processing_class=tokenizer)


def snapshot(model):
    """A float64 copy of the weights in a fresh model (a deepcopy of a TRL-patched model would keep calling the
    original's forward: TRL's fused-head patch closes over it)."""
    copy_ = type(model)(model.config)
    copy_.load_state_dict(model.state_dict())
    return copy_.double()


def completion_logp(model, out):
    """float64 log-probs of the completion tokens under `model` at the sampling temperature, [B, C], with graph."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attention = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    c = out["completion_ids"].shape[1]
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, -c - 1:-1].double()
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, ids[:, -c:, None]).squeeze(-1)


def brute_force_sq_norms(model, out, how):
    """G_i of VCPOConfig.grad_norms `how`: ||grad sum_t log pi(y_it)||^2 over every parameter ("exact") or the LM
    head's ("lm_head"), one sequence at a time in float64; the counted length ("length")."""
    mask = out["completion_mask"] != 0
    if how == "length":
        return mask.sum(1).double()
    params = list(model.parameters() if how == "exact" else model.get_output_embeddings().parameters())
    norms = []
    for i in range(mask.shape[0]):
        row = {k: out[k][i:i + 1] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        logp = completion_logp(model, row)
        grads = torch.autograd.grad(torch.where(mask[i:i + 1], logp, 0).sum(), params, allow_unused=True)
        norms.append(sum(((g.double() ** 2).sum() for g in grads if g is not None),
                         torch.zeros((), dtype=torch.float64)))
    return torch.stack(norms)


@pytest.fixture
def recorded(monkeypatch):
    """`install(policy, stale)`: every training generation batch of TRL, with a snapshot of the policy that made it;
    with `stale`, its `sampling_per_token_logps` (as vLLM gives them) come from a perturbed copy of `policy`, so the
    weights, ESS and lr scale are off-policy ones."""
    batches = []

    def install(policy, stale=True):
        if stale:
            torch.manual_seed(1)
            stale = snapshot(policy)
            with torch.no_grad():
                for p in stale.parameters():
                    p.add_(1.5 * p.std().nan_to_num(0) * torch.randn_like(p))
        original = GRPOTrainer._generate_and_score_completions

        def generate(self, inputs):
            out = original(self, inputs)
            if self.model.training:
                if stale:
                    with torch.no_grad():
                        out["sampling_per_token_logps"] = completion_logp(stale, out).float()
                # The policy before this batch's steps, for the float64 references.
                batches.append((out, snapshot(self.model)))  # out: VCPO's fields are added to it after
            return out

        monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", generate)
        return batches

    return install


def reference(policy, out, config):
    """The generation batch under `policy` (a snapshot) through vcpo.policy_loss in float64, with brute-force G_i,
    the rewards recomputed from the completions and the prompt groups from TRL's layout (runs of N_GEN rows)."""
    mask = out["completion_mask"] != 0
    logp = completion_logp(policy, out).detach()
    behaviour = out["sampling_per_token_logps"].double()
    b = mask.shape[0]
    res = vcpo.policy_loss(logp, behaviour, config=config.replace(backend="torch"), mask=mask, rewards=reward_of(out),
                           group_index=torch.arange(b) // N_GEN,
                           grad_sq_norm=brute_force_sq_norms(policy, out, config.grad_norms))
    # The ESS and lr scale from their definitions: w_i = exp(sum_t log pi - log mu), rho = (sum w)^2 / (B sum w^2).
    w = torch.where(mask, logp - behaviour, 0).sum(1).exp()
    rho = w.sum() ** 2 / (b * (w ** 2).sum())
    x = min(1.0, float(rho))
    return res, float(rho), {"sqrt": math.sqrt(x), "linear": x, None: 1.0}[config.lr_rule]


@pytest.mark.parametrize("grad_norms", ["exact", "lm_head", "length"])
def test_vcpo_trains_and_matches_policy_loss(tokenizer, recorded, grad_norms):
    """Two steps of one generation batch each: advantages (with each kind of G_i), ESS, lr scale and the loss
    against float64 recomputations on the same completions; the scaled lr is in the step and restored after it."""
    model = tiny_model(tokenizer)
    batches = recorded(model)
    config = VCPOConfig(grad_norms=grad_norms)
    trainer = make(VCPOGRPOTrainer, tokenizer, model, vcpo_config=config)
    recorder = Recorder()
    trainer.add_callback(recorder)
    losses = []
    compute_loss = trainer.compute_loss
    trainer.compute_loss = lambda *a, **k: losses.append(compute_loss(*a, **k)) or losses[-1]
    start = [p.detach().clone() for p in model.parameters()]
    trainer.train()

    assert len(batches) == 2 and len(losses) == 2 and len(recorder.scaled) == 2
    assert any(not torch.equal(a, p) for a, p in zip(start, model.parameters()))
    logs = [h for h in trainer.state.log_history if "vcpo/ess_ratio" in h]
    assert len(logs) == 2
    # The completions table (the last generation batch) shows the advantages trained on.
    assert list(trainer._logs["advantages"]) == batches[-1][0]["advantages"].tolist()
    for (out, policy), loss, log, scaled, base, after in zip(batches, losses, logs, recorder.scaled, recorder.base,
                                                             recorder.after):
        res, rho, scale = reference(policy, out, config)
        assert 0.05 < rho < 0.95  # off-policy: the check of the lr scale is not the trivial 1
        torch.testing.assert_close(out["advantages"].double(), res.advantages, rtol=1e-4, atol=1e-4)
        assert log["vcpo/ess_ratio"] == pytest.approx(rho, rel=1e-4)
        assert log["vcpo/ess"] == pytest.approx(rho * len(out["advantages"]), rel=1e-4)
        assert log["vcpo/lr_scale"] == pytest.approx(scale, rel=1e-4)
        assert log["vcpo/baseline_mean"] == pytest.approx(float(res.baseline.mean()), rel=1e-4, abs=1e-4)
        # One chunk per generation batch: its loss is the whole batch's (the rows are shuffled; a mean is not).
        assert float(loss) == pytest.approx(float(res.loss), rel=1e-4, abs=1e-5)
        assert scaled == pytest.approx(base * scale, rel=1e-4) and after == base


def test_parts_off_gradient_equals_grpo_trainer(tokenizer):
    """No IS correction, group-mean advantages (TRL scale_rewards='none'), no ESS scaling, TRL's 'grpo'
    aggregation (seq-mean-token-mean): VCPO's gradient on the batch equals GRPOTrainer's own."""
    off = VCPOConfig(is_correction="none", advantage="grpo", norm_by_std=False, lr_rule=None,
                     loss_agg_mode="seq-mean-token-mean", grad_norms="uniform")
    grads, outs = [], []
    for cls, config_cls, extra in ((GRPOTrainer, GRPOConfig, {}), (VCPOGRPOTrainer, VCPOGRPOConfig,
                                                                    {"vcpo_config": off})):
        model = tiny_model(tokenizer)
        trainer = make(cls, tokenizer, model, config_cls, loss_type="grpo", scale_rewards="none", **extra)
        trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which this test skips
        model.train()
        batch = next(iter(trainer.get_train_dataloader()))
        torch.manual_seed(0)
        inputs = trainer._prepare_inputs(batch)
        model.zero_grad()
        trainer.compute_loss(model, inputs).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        outs.append(inputs)
    trl_in, vcpo_in = outs
    assert torch.equal(trl_in["completion_ids"], vcpo_in["completion_ids"])  # the same batch, row for row
    torch.testing.assert_close(vcpo_in["advantages"], trl_in["advantages"], rtol=1e-5, atol=1e-6)
    assert sum(float(g.abs().sum()) for g in grads[0]) > 0
    for g_trl, g_vcpo in zip(*grads):
        torch.testing.assert_close(g_vcpo, g_trl, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("trl_loss, rule, mode", [
    (dict(loss_type="cispo", epsilon_high=1.1), "cispo", "token-mean"),
    (dict(loss_type="sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=3.0), "sapo", "seq-mean-token-mean"),
    (dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.02, epsilon_high=0.03), "gspo",
     "seq-mean-token-mean"),
], ids=["cispo", "sapo", "gspo"])
def test_trls_trust_regions_pass_through(tokenizer, trl_loss, rule, mode):
    """TRL's loss_type / importance_sampling_level name the trust region; off-policy (TRL's old log-probs from
    generation, then the weights moved, so the ratio is not 1), VCPO's gradient on the batch equals GRPOTrainer's
    own for the same rule (no IS correction of VCPO's own, group-mean advantages, no ESS scaling)."""
    off = VCPOConfig(is_correction="none", advantage="grpo", norm_by_std=False, lr_rule=None, loss_agg_mode=mode,
                     grad_norms="uniform")
    grads, trainers = [], []
    for cls, config_cls, extra in ((GRPOTrainer, GRPOConfig, {}), (VCPOGRPOTrainer, VCPOGRPOConfig,
                                                                    {"vcpo_config": off})):
        model = tiny_model(tokenizer)
        trainer = make(cls, tokenizer, model, config_cls, scale_rewards="none", num_iterations=2, **trl_loss, **extra)
        trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which this test skips
        model.train()
        batch = next(iter(trainer.get_train_dataloader()))
        torch.manual_seed(0)
        inputs = trainer._prepare_inputs(batch)  # the old log-probs: the behaviour policy
        with torch.no_grad():  # the policy moves on: the same move for both
            g = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        model.zero_grad()
        trainer.compute_loss(model, inputs).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        trainers.append(trainer)
    assert trainers[1].vcpo_config.trust_rule == rule
    assert sum(float(g.abs().sum()) for g in grads[0]) > 0
    for g_trl, g_vcpo in zip(*grads):
        torch.testing.assert_close(g_vcpo, g_trl, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("overrides, words", [
    (dict(loss_type="cispo"), "epsilon_high >= 1"),  # TRL's default cap 0.2
    (dict(loss_type="sapo", vcpo_config=VCPOConfig(is_correction="none", clip_ratio=(0.2, 0.2))), "set it in one"),
    (dict(loss_type="sapo"), "is_correction='truncate' would weight each unit a second time"),
    (dict(loss_type="cispo", epsilon_high=5.0, importance_sampling_level="sequence"), "per token only"),
])
def test_trl_trust_regions_refused_where_ambiguous(tokenizer, overrides, words):
    with pytest.raises(ValueError, match=words):
        make(VCPOGRPOTrainer, tokenizer, tiny_model(tokenizer), **overrides)


def test_steps_per_generation_baselines_once_per_generation_batch(tokenizer, recorded):
    """steps_per_generation=3 with 4-sequence chunks: TRL shuffles the 12-sequence generation batch and splits
    it, so chunks hold parts of prompt groups. Every chunk's advantages are the whole batch's (by row), both
    optimizer steps of it take its lr scale, and each step's loss is its chunk's share."""
    model = tiny_model(tokenizer)
    batches = recorded(model)
    trainer = make(VCPOGRPOTrainer, tokenizer, model, per_device_train_batch_size=4, steps_per_generation=3,
                   max_steps=3)
    recorder = Recorder()
    trainer.add_callback(recorder)
    chunks = []
    prepare = trainer._prepare_inputs
    trainer._prepare_inputs = lambda batch: chunks.append(prepare(batch)) or chunks[-1]
    trainer.train()

    assert len(batches) == 1 and len(chunks) == 3
    out, policy = batches[0]
    res, rho, scale = reference(policy, out, VCPOConfig())
    assert 0.05 < rho < 0.95
    rows = {(tuple(p.tolist()), tuple(c.tolist())): a for p, c, a in
            zip(out["prompt_ids"], out["completion_ids"], res.advantages)}
    split_groups = 0
    for chunk in chunks:
        expected = torch.stack([rows[(tuple(p.tolist()), tuple(c.tolist()))]
                                for p, c in zip(chunk["prompt_ids"], chunk["completion_ids"])])
        torch.testing.assert_close(chunk["advantages"].double(), expected, rtol=1e-4, atol=1e-4)
        split_groups += len({tuple(p.tolist()) for p in chunk["prompt_ids"]}) > 1
        assert chunk["vcpo_share"] == 1.0  # one chunk per optimizer step (gradient_accumulation_steps=1)
    assert split_groups > 0  # the chunks do cut the prompt groups
    assert len(recorder.scaled) == 3
    for scaled, base in zip(recorder.scaled, recorder.base):
        assert scaled == pytest.approx(base * scale, rel=1e-4)


def test_chunk_shares_of_an_accumulated_step(tokenizer):
    """gradient_accumulation_steps=2, token-mean: a step's two chunks weigh by their token counts."""
    trainer = make(VCPOGRPOTrainer, tokenizer, tiny_model(tokenizer), per_device_train_batch_size=4,
                   gradient_accumulation_steps=2, steps_per_generation=4,
                   vcpo_config=VCPOConfig(loss_agg_mode="token-mean"))
    masks = [torch.tensor([[1, 1, 0], [1, 0, 0]]), torch.tensor([[1, 1, 1], [0, 0, 0]]),
             torch.tensor([[1, 0, 0], [0, 0, 0]]), torch.tensor([[0, 0, 0], [0, 0, 0]])]
    chunks = [{"completion_mask": m} for m in masks]
    trainer._set_shares(chunks)
    assert [c["vcpo_share"] for c in chunks] == [3 / 6, 3 / 6, 1.0, 0.0]


class _Steps(TrainerCallback):
    """The weights and the optimizer's state after each optimizer step, and whether its `step` was left a no-op."""

    def __init__(self):
        self.after = []

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.after.append(([p.detach().clone() for p in model.parameters()], copy.deepcopy(optimizer.state_dict()),
                           vars(optimizer).get("step") is _no_step))


@pytest.mark.parametrize("value", [-math.inf, math.nan], ids=["-inf", "nan"])
def test_a_nonfinite_step_is_skipped_whole(tokenizer, recorded, monkeypatch, value):
    """The first generation batch has one behaviour log-prob of -inf (its ESS is NaN) or NaN (TRL's own rule gives a
    token vLLM could not score weight 1, so here the policy's log-prob is made NaN instead): its optimizer step is
    skipped, as vcpo.step skips one, with the weights and AdamW's state as they were; the next batch's step is
    taken. Logged: vcpo/skipped 1 then 0."""
    model = tiny_model(tokenizer)
    batches = recorded(model, stale=False)
    start = [p.detach().clone() for p in model.parameters()]
    trainer = make(VCPOGRPOTrainer, tokenizer, model, vcpo_config=VCPOConfig(grad_norms="length"))
    original = VCPOGRPOTrainer._logps_and_norms

    def poisoned(self, out, mask):
        logp, g = original(self, out, mask)
        if len(batches) == 1:  # the first generation batch
            row, col = mask.nonzero()[0].tolist()
            if value == -math.inf:
                out["sampling_per_token_logps"] = logp.detach().clone()
                out["sampling_per_token_logps"][row, col] = value
            else:
                logp = logp.clone()
                logp[row, col] = value
        return logp, g

    monkeypatch.setattr(VCPOGRPOTrainer, "_logps_and_norms", poisoned)
    steps = _Steps()
    trainer.add_callback(steps)
    trainer.train()

    (first, state1, patched1), (second, state2, patched2) = steps.after
    assert all(torch.equal(a, b) for a, b in zip(first, start))  # bitwise: no 0 x NaN, no weight decay
    assert state1["state"] == {}  # AdamW never stepped: no moments, no step count
    assert any(not torch.equal(a, b) for a, b in zip(second, start))
    assert all(torch.isfinite(p).all() for p in second)
    assert {int(s["step"]) for s in state2["state"].values()} == {1}
    assert not patched1 and not patched2  # the optimizer's own step is back
    logs = [h for h in trainer.state.log_history if "vcpo/skipped" in h]
    assert [h["vcpo/skipped"] for h in logs] == [1.0, 0.0]


@pytest.mark.parametrize("overrides, words", [
    ({"beta": 0.1}, "beta=0.1"),
    ({"steps_per_generation": 3, "gradient_accumulation_steps": 2}, "steps_per_generation=3"),
    ({"top_entropy_quantile": 0.5}, "top_entropy_quantile=0.5"),
    ({"off_policy_mask_threshold": 0.5}, "off_policy_mask_threshold=0.5"),
    ({"entropy_coef": 0.01}, "entropy bonus"),
])
def test_unsupported_options_are_refused(tokenizer, tmp_path, overrides, words):
    model = tiny_model(tokenizer)
    model.save_pretrained(tmp_path)  # beta > 0 loads a reference model from the model's folder
    with pytest.raises(ValueError, match=words):
        make(VCPOGRPOTrainer, tokenizer, str(tmp_path), **overrides)


def test_unscorable_completions_are_refused(tokenizer):
    trainer = make(VCPOGRPOTrainer, tokenizer, tiny_model(tokenizer))
    trainer.reward_funcs = [lambda completions, **kwargs: [None] * len(completions)]
    with pytest.raises(ValueError, match="no reward"):
        trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def test_config_serialises_for_the_loggers():
    args = VCPOGRPOConfig(output_dir="/tmp/vcpo-trl-test", report_to=[], use_cpu=True,
                          vcpo_config=VCPOConfig(is_threshold=4.0, clip_ratio=(0.2, 0.3)))
    assert json.loads(args.to_json_string())["vcpo_config"]["is_threshold"] == 4.0


def test_core_package_does_not_import_trl():
    code = "import sys, vcpo, vcpo.integrations; print('trl' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "False"


@pytest.mark.slow
def test_vllm_colocate_sampling_logprobs(tokenizer, recorded, monkeypatch, tmp_path):
    """TRL's vLLM colocate mode with vLLM's CPU build (in-process engine): the behaviour policy is vLLM's sampling
    log-probs, and the generation batch's ESS, lr scale and advantages against float64 references with them, over
    two optimizer steps (steps_per_generation=2). TRL's own weight sync calls model.load_weights, which vLLM's CPU
    runner does not support; the test syncs through vLLM's reload_weights from a safetensors folder instead."""
    import trl.generation.vllm_generation as vllm_generation

    for name, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0")):
        monkeypatch.setenv(name, value)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # TRL sets them for vLLM
        monkeypatch.setenv(name, os.environ.get(name, ""))
        monkeypatch.delenv(name)
    sync_dir = tmp_path / "sync"

    def sync_weights(self):
        self.accelerator.unwrap_model(self.model).save_pretrained(sync_dir)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(sync_dir)})
        self.llm.reset_prefix_cache()

    monkeypatch.setattr(vllm_generation.VLLMGeneration, "sync_weights", sync_weights)
    tokenizer = copy.copy(tokenizer)
    tokenizer.padding_side = "left"
    model = build_model(TinyRecipe(hidden_size=64, num_heads=2, intermediate_size=128, num_layers=1), len(tokenizer))
    model.save_pretrained(tmp_path / "model")  # vLLM's CPU attention needs head_dim >= 32
    tokenizer.save_pretrained(tmp_path / "model")
    batches = recorded(model, stale=False)
    trainer = make(VCPOGRPOTrainer, tokenizer, str(tmp_path / "model"), use_vllm=True, vllm_mode="colocate",
                   vllm_max_model_length=64, vllm_enable_sleep_mode=False, steps_per_generation=2, max_steps=2)
    recorder = Recorder()
    trainer.add_callback(recorder)
    try:
        trainer.train()
    finally:
        del trainer.vllm_generation.llm
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert len(batches) == 1 and len(recorder.scaled) == 2
    out, policy = batches[0]
    assert torch.equal(out["vcpo_behavior_logps"], out["sampling_per_token_logps"])
    res, rho, scale = reference(policy, out, VCPOConfig())
    log = next(h for h in trainer.state.log_history if "vcpo/ess_ratio" in h)
    torch.testing.assert_close(out["advantages"].double(), res.advantages, rtol=1e-4, atol=1e-4)
    assert log["vcpo/ess_ratio"] == pytest.approx(rho, rel=1e-5) and log["vcpo/lr_scale"] == pytest.approx(scale, rel=1e-5)
    for scaled, base in zip(recorder.scaled, recorder.base):
        assert scaled == pytest.approx(base * scale, rel=1e-5)


# -- several processes ---------------------------------------------------------------------------------------------

GLOBAL_BATCH = 12  # 3 prompt groups of N_GEN per generation batch; on 2 processes, 6 rows each (a group spans both)


def fixed_rollout(stale):
    """A TRL `rollout_func` whose completions and behaviour log-probs depend only on the row's place in the global
    generation batch and the step (not on the process count or the sampling RNG), so one and two processes train on
    the same batches; the log-probs are `stale`'s (a perturbed copy of the policy), so the weights are off-policy."""
    def rollout(prompts, trainer):
        tokenizer = trainer.processing_class
        first = trainer.accelerator.process_index * len(prompts)
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for i, prompt in enumerate(prompts):
            rng = torch.Generator().manual_seed(1000 * trainer.state.global_step + first + i)
            length = int(torch.randint(2, 7, (), generator=rng))
            completion = torch.randint(4, len(tokenizer), (length,), generator=rng).tolist()
            prompt_ids = tokenizer(prompt)["input_ids"]
            row = {"prompt_ids": torch.tensor([prompt_ids]), "prompt_mask": torch.ones(1, len(prompt_ids)),
                   "completion_ids": torch.tensor([completion]), "completion_mask": torch.ones(1, length)}
            with torch.no_grad():
                logprobs = completion_logp(stale, row)[0].tolist()
            for key, value in zip(out, (prompt_ids, completion, logprobs)):
                out[key].append(value)
        return out
    return rollout


def train_processes(path):
    """One training run of 2 generation batches of GLOBAL_BATCH rows, each one SGD step of two accumulated chunks,
    on however many processes launched it; process 0 saves the weights, logs and scaled lrs to `path`."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # rollout_func's warning
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer = build_tokenizer()
    model = tiny_model(tokenizer)
    torch.manual_seed(1)
    stale = snapshot(model)
    with torch.no_grad():
        for p in stale.parameters():
            p.add_(4.0 * p.std().nan_to_num(0) * torch.randn_like(p))
    args = VCPOGRPOConfig(output_dir="/tmp/vcpo-trl-test", per_device_train_batch_size=GLOBAL_BATCH // 2 // world,
                          steps_per_generation=2, gradient_accumulation_steps=2, num_generations=N_GEN,
                          max_completion_length=6, max_steps=2, optim="sgd", learning_rate=0.5, logging_steps=1,
                          report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0,
                          temperature=TEMPERATURE, disable_tqdm=True)
    trainer = VCPOGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset(),
                              processing_class=tokenizer, rollout_func=fixed_rollout(stale))
    recorder = Recorder()
    trainer.add_callback(recorder)
    trainer.train()
    if trainer.accelerator.is_main_process:
        logs = [{k: v for k, v in h.items() if k.startswith("vcpo/")} for h in trainer.state.log_history
                if "vcpo/ess_ratio" in h]
        torch.save({"world": trainer.accelerator.num_processes, "weights": model.state_dict(), "logs": logs,
                    "advantages": list(trainer._logs["advantages"]), "scaled": recorder.scaled,
                    "base": recorder.base}, path)


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    """`accelerate launch --num_processes 2` (gloo on the CPU) against one process on the same generation batches
    (each 12 rows, 6 per process, a prompt group across the two): the ESS, lr scale, baselines and advantages are the
    whole batch's on every process and the two SGD updates are the same."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    # --cpu would take accelerate's one-process launcher; torchrun's (--multi_gpu) with use_cpu=True in the training
    # arguments gives two CPU processes on gloo (accelerate's MULTI_CPU).
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
           "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), __file__, str(tmp_path / "2.pt")]
    with open(tmp_path / "launch.log", "w") as log:  # a file, not a pipe nobody reads while this process trains
        launched = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        train_processes(tmp_path / "1.pt")  # meanwhile, one process: this one
        launched.wait(timeout=600)
    assert launched.returncode == 0, (tmp_path / "launch.log").read_text()[-4000:]
    one, two = (torch.load(tmp_path / f"{world}.pt") for world in (1, 2))
    assert (one["world"], two["world"]) == (1, 2)
    assert len(one["logs"]) == len(two["logs"]) == 2 and len(one["scaled"]) == len(two["scaled"]) == 2
    for a, b in zip(one["logs"], two["logs"]):
        assert 0.05 < a["vcpo/ess_ratio"] < 0.95  # off-policy: the lr scale is not the trivial 1
        for key in ("vcpo/ess_ratio", "vcpo/ess", "vcpo/lr_scale", "vcpo/baseline_mean", "vcpo/grad_sq_norm_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert len(one["advantages"]) == GLOBAL_BATCH
    torch.testing.assert_close(torch.tensor(two["advantages"]), torch.tensor(one["advantages"]), rtol=1e-5, atol=1e-6)
    assert two["scaled"] == pytest.approx(one["scaled"], rel=1e-6)
    start = tiny_model(build_tokenizer()).state_dict()
    assert any(not torch.equal(start[k], v) for k, v in one["weights"].items())
    for key, value in one["weights"].items():
        torch.testing.assert_close(two["weights"][key], value, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":  # the training run of test_two_processes_equal_one, under `accelerate launch` or not
    train_processes(sys.argv[1])
