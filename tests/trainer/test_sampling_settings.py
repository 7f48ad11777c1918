"""Sampling settings (docs/trainer.md, "Sampling settings"). At each temperature and top-k / top-p tested, right
after a weight sync, the engine's behaviour log-probs of the sampled tokens and the trainer's (vcpo.step's own
forward, with the plain and the fused LM head) agree to 1e-4: an in-process engine, and a server of the pool
started by LocalServers; the whole vcpo.step at a temperature and with top-k / top-p against a float64 loop, and a
`vcpo train --temperature --top-k --top-p` run on-policy at k = 0. Invalid settings are refused, and so is a
running server whose log-probs come before the temperature and the truncation."""

import asyncio
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from vcpo.trainer.config import make_config
from vcpo_kernels import truncates as vk_truncates

# (temperature, top_k, top_p): the default, sharper, flatter, then top-k, top-p and both
SAMPLINGS = ((1.0, -1, 1.0), (0.6, -1, 1.0), (1.5, -1, 1.0), (1.0, 8, 1.0), (0.9, -1, 0.8), (1.2, 20, 0.9))
PROMPT_TEXT = "12+34="
HERE = os.path.dirname(os.path.abspath(__file__))


def trainer_gaps(model, prompt, completions, sampling):
    """The largest |trainer - engine| log-prob over the completions' tokens, with the trainer's log-probs from
    vcpo.step's forward pass under VCPOConfig(temperature, top_k, top_p), plain and fused LM head, and how many
    tokens the trainer's support leaves out; and the same at temperature 1 without truncation (the log-probs
    before both), to show the check can fail."""
    import torch

    from vcpo import VCPOConfig
    from vcpo.step import RolloutBatch, _Pass
    from vcpo.trainer.rollouts import Rollout, pad_rollouts

    rollouts = [Rollout(batch=0, prompt_index=0, response_index=j, prompt_ids=list(prompt),
                        response_ids=c.token_ids, behavior_logp=c.logprobs, finish_reason=c.finish_reason,
                        reward=0.0, version=0) for j, c in enumerate(completions)]
    ids, attn, loss_mask, mu = pad_rollouts(rollouts, pad_id=0)
    batch = RolloutBatch(ids, attn, loss_mask, mu, torch.zeros(len(rollouts)))
    mask = loss_mask[:, 1:] != 0
    gaps = {}
    t, top_k, top_p = sampling
    for name, options in (("plain", dict(temperature=t, top_k=top_k, top_p=top_p)),
                          ("fused", dict(temperature=t, top_k=top_k, top_p=top_p, fused_lm_head=True)),
                          ("untempered", {})):
        part = _Pass(model, batch, VCPOConfig(**options), norms=False, keep=False, bookkeeping=False)
        inside = mask & (part.logp > -torch.inf)
        gaps[name] = (part.logp - mu[:, 1:]).abs()[inside].max().item()
        gaps[f"{name}_outside"] = int((mask & ~inside).sum())
    gaps["tokens"] = int(mask.sum())
    return gaps


def stale_and_new_model():
    """The built-in architecture, random: the engine starts from `old`; the trainer then holds `new`, far from it."""
    import torch

    from vcpo.trainer import tiny

    tok = tiny.build_tokenizer()
    torch.manual_seed(0)
    old = tiny.build_model(tiny.TinyRecipe(), len(tok))
    new = tiny.build_model(tiny.TinyRecipe(), len(tok))
    with torch.no_grad():
        for p0, p1 in zip(old.parameters(), new.parameters()):
            p1.copy_(p0 + 0.3 * torch.randn_like(p0))
    return tok, old, new


def check_gaps(results):
    print(json.dumps(results))  # the measured gaps, with pytest -s
    for key, g in results.items():
        assert g["tokens"] >= 8, (key, g)  # a random model may end a continuation early, not all four
        assert g["plain"] < 1e-4 and g["fused"] < 1e-4, (key, g)
        # right after a sync a sampled token is outside the trainer's support only at the edge, by rounding
        assert g["plain_outside"] + g["fused_outside"] <= 1, (key, g)
        if key != str(SAMPLINGS[0]):  # the log-probs before the temperature and truncation are far off
            assert g["untempered"] > 1e-2, (key, g)


def long_seeded_batch(generate, tok):
    """A seeded batch of more prompt tokens than an engine step takes (vLLM's CPU default: 4096 in-process, 2048 in
    a server), generated twice: (its prompt tokens, the two runs' sampled tokens equal). On vLLM's CPU build a
    prompt split over two steps crashed the engine (vcpo.trainer.engines.rollout_engine.unsplit_prefill)."""
    from vcpo.trainer import tiny

    prompts = [[tiny.BOS] + tok.encode(f"{i}+{i}=" * 12)[:59] for i in range(100)]
    runs = [[c[0].token_ids for c in generate(prompts, n=1, max_tokens=2, temperature=1.0, seeds=list(range(100)))]
            for _ in range(2)]
    return sum(map(len, prompts)), runs[0] == runs[1]


def check_long_batch(tokens, same):
    assert tokens > 4096 and same, (tokens, same)


# -- vcpo.step at a temperature, with and without top-k / top-p ----------------------------------------------------
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("t, top_k, top_p, is_level", [(0.6, -1, 1.0, "sequence"), (0.8, 36, 0.95, "token")])
def test_step_at_a_temperature_against_a_per_sequence_loop(fused, t, top_k, top_p, is_level):
    """The whole update at a temperature, and with top-k / top-p (exact per-sequence norms, the loss, the SGD step)
    against float64 log-probs of softmax(logits / T) over the sampling support written out, with one backward per
    sequence; the batch's random tokens fall outside that support in places (weight 0, no gradient)."""
    import copy

    import torch

    import vcpo
    import vcpo_kernels as vk
    from support.tiny_models import rollout_batch, tiny_llama

    model = tiny_llama()
    batch = rollout_batch(model)
    reference = copy.deepcopy(model)
    sampling = dict(temperature=t, top_k=top_k, top_p=top_p)
    config = vcpo.VCPOConfig(**sampling, is_level=is_level, ess_base_ratio=1.0, grad_clip=None, backend="cpu",
                             fused_lm_head=fused)
    metrics = vcpo.step(model, torch.optim.SGD(model.parameters(), lr=1e-2), batch, config)
    untempered = vcpo.step(copy.deepcopy(reference), torch.optim.SGD(reference.parameters(), lr=0.0), batch,
                           config.replace(temperature=1.0, top_k=-1, top_p=1.0))

    params = list(reference.parameters())
    mask = batch.loss_mask[:, 1:] != 0
    z = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1] / t
    keep = vk.sampling_support(z, top_k, top_p)  # checked against a loop and vLLM: test_truncated_sampling.py
    z = z.masked_fill(~keep, -torch.inf)
    y = batch.input_ids[:, 1:, None]
    inside = keep.gather(-1, y)[..., 0]
    logp = torch.where(inside, (z - z.logsumexp(-1, keepdim=True)).gather(-1, y)[..., 0], -torch.inf)
    counted = torch.where(inside, logp, 0)
    g_sq = torch.stack([sum(g.pow(2).sum() for g in torch.autograd.grad((counted[i] * mask[i]).sum(), params,
                                                                        retain_graph=True))
                        for i in range(logp.shape[0])])
    leaf = logp.detach().requires_grad_()
    out = vk.policy_loss(leaf, batch.behavior_logp[:, 1:], mask=mask, rewards=batch.rewards,
                         group_index=batch.group_index, grad_sq_norm=g_sq, options=config, backend="torch")
    (dlogp,) = torch.autograd.grad(out.loss, leaf)
    grads = torch.autograd.grad((counted * dlogp).sum(), params)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p -= 1e-2 * out.lr_scale.item() * g
    outside = (~inside & mask).sum().item()
    assert metrics["outside_support_fraction"] == pytest.approx(outside / mask.sum().item(), rel=1e-12)
    assert (outside > 0) == (top_k > 0)
    assert metrics["grad_sq_norm_mean"] == pytest.approx(g_sq.mean().item(), rel=1e-9)
    assert metrics["loss"] == pytest.approx(out.loss.item(), rel=1e-6)
    assert metrics["kl_k3"] == pytest.approx(out.kl_k3.item(), rel=1e-6) and math.isfinite(metrics["kl_k3"])
    assert metrics["lr_scale"] == pytest.approx(out.lr_scale.item(), rel=1e-6)
    # the sampling matters: the untempered, untruncated step is another
    assert max(abs(untempered[k] / metrics[k] - 1) for k in ("grad_sq_norm_mean", "loss")) > 1e-2
    for (name, p), q in zip(model.named_parameters(), params):
        torch.testing.assert_close(p, q, rtol=1e-7, atol=1e-9, msg=lambda m: f"{name}: {m}")


# -- refused and invalid settings ---------------------------------------------------------------------------------
@pytest.mark.parametrize("setting, message", [
    ({"temperature": 0}, "temperature must be a finite number > 0, got 0"),
    ({"temperature": -1.0}, "temperature must be a finite number > 0"),
    ({"temperature": float("nan")}, "temperature must be a finite number > 0"),
    ({"temperature": float("inf")}, "temperature must be a finite number > 0"),
    ({"temperature": True}, "temperature must be a finite number > 0"),
    ({"temperature": "hot"}, "temperature must be a finite number > 0"),
    ({"top_p": 0}, r"top_p must be a number in \(0, 1\], got 0"),
    ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\]"),
    ({"top_k": -2}, "top_k must be an integer >= -1"),
    ({"top_k": 2.5}, "top_k must be an integer >= -1"),
    ({"vcpo": {"temperature": 0.5}}, "vcpo.temperature follows the temperature setting: set temperature instead"),
    ({"vcpo": {"top_k": 5}}, "vcpo.top_k follows the top_k setting: set top_k instead"),
    ({"vcpo": {"top_p": 0.5}}, "vcpo.top_p follows the top_p setting: set top_p instead"),
])
def test_bad_sampling_settings_name_the_setting(setting, message):
    with pytest.raises(ValueError, match=message):
        make_config(**setting)


def test_settings_reach_the_trainers_log_probs(capsys):
    from vcpo.trainer.cli import main

    for off in ({}, {"top_p": 1.0}, {"top_p": 1}, {"top_k": -1}, {"top_k": 0}):
        options = make_config(**off).vcpo_config()
        assert options.temperature == 1.0 and not vk_truncates(options.top_k, options.top_p)
    cfg = make_config(temperature=0.7, top_k=20, top_p=0.9)
    options = cfg.vcpo_config()
    assert (options.temperature, options.top_k, options.top_p) == (0.7, 20, 0.9)
    assert {k: cfg.to_dict()[k] for k in ("temperature", "top_k", "top_p")} == {  # in config.json
        "temperature": 0.7, "top_k": 20, "top_p": 0.9}
    # the flags parse and reach the settings: the run is refused for another setting, then for top_p itself
    assert main(["train", "--top-k", "20", "--top-p", "0.9", "--max-staleness", "-1"]) == 2
    assert "vcpo train: error: max_staleness must be an integer >= 0" in capsys.readouterr().err
    assert main(["train", "--top-k", "20", "--top-p", "1.5"]) == 2
    assert "vcpo train: error: top_p must be a number in (0, 1]" in capsys.readouterr().err


# -- a running server's log-prob mode ------------------------------------------------------------------------------
@pytest.mark.parametrize("answer, refused", [
    ((200, {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}}}), None),
    ((200, {"vllm_config": {"model_config": {"logprobs_mode": "raw_logprobs"}}}),
     "reports raw_logprobs .*start it with --logprobs-mode processed_logprobs"),
    ((404, {"detail": "Not Found"}), "does not report its logprobs_mode at /server_info"),
])
def test_a_server_must_report_the_log_probs_after_the_temperature(answer, refused):
    import httpx

    from vcpo.trainer.engines.pool import check_logprobs_mode

    def reply(request):
        assert request.url.path == "/server_info" and request.url.params["config_format"] == "json"
        return httpx.Response(answer[0], json=answer[1])

    async def check():
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply), base_url="http://node1:8000") as client:
            await check_logprobs_mode(client, "http://node1:8000", "engine_urls")

    if refused is None:
        asyncio.run(check())
    else:
        with pytest.raises(ValueError, match=f"^engine_urls: http://node1:8000 {refused}"):
            asyncio.run(check())


# -- engines -------------------------------------------------------------------------------------------------------
INPROCESS = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[2])
    from test_sampling_settings import PROMPT_TEXT, SAMPLINGS, long_seeded_batch, stale_and_new_model, trainer_gaps
    from vcpo.trainer import tiny
    from vcpo.trainer.engines.rollout_engine import RolloutEngine
    folder = sys.argv[1]
    tok, old, new = stale_and_new_model()
    old.save_pretrained(folder); tok.save_pretrained(folder)
    engine = RolloutEngine(folder, mode="inprocess", max_model_len=64)
    engine.load_weights({k: v.clone() for k, v in new.state_dict().items()}, 1)
    prompt = [tiny.BOS] + tok.encode(PROMPT_TEXT)
    results = {}
    for t, k, p in SAMPLINGS:  # one engine: the sampling settings are per request
        completions = engine.generate([prompt], n=4, max_tokens=12, temperature=t, top_k=k, top_p=p, seeds=[7])[0]
        results[str((t, k, p))] = trainer_gaps(new, prompt, completions, (t, k, p))
    print(json.dumps({"gaps": results, "long_batch": long_seeded_batch(engine.generate, tok)}))
    engine.close()
""")


@pytest.mark.slow
def test_inprocess_engine_and_trainer_agree_after_a_sync(tmp_path):
    pytest.importorskip("vllm")
    script = tmp_path / "check.py"
    script.write_text("if __name__ == '__main__':\n" + textwrap.indent(INPROCESS, "    "))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "model"), HERE], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    check_gaps(result["gaps"])
    check_long_batch(*result["long_batch"])


@pytest.mark.slow
def test_server_engine_and_trainer_agree_after_a_sync(tmp_path):
    """A server started by LocalServers passes the pool's check at a temperature other than 1 and with top-k / top-p
    (it reports the processed log-probs) and, after a sync, its log-probs are the trainer's at each sampling setting;
    a seeded batch longer than a step's token budget is sampled, the same twice."""
    pytest.importorskip("vllm")
    from vcpo.trainer import tiny
    from vcpo.trainer.engines.pool import ServerPool
    from vcpo.trainer.engines.servers import LocalServers

    tok, old, new = stale_and_new_model()
    old.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    servers = LocalServers(str(tmp_path / "model"), 1, log_dir=str(tmp_path / "logs"), dtype="float32",
                           max_model_len=64, kv_cache_gib=1, seed=0)
    pool = None
    try:
        urls = servers.start()
        pool = ServerPool(urls, weights_dir=str(tmp_path / "weights"))
        prompt = [tiny.BOS] + tok.encode(PROMPT_TEXT)
        pool.check(setting="engine_servers", probe_text=PROMPT_TEXT, max_model_len=64, temperature=0.6, top_k=8,
                   top_p=0.9, probe_ids=tok.encode(PROMPT_TEXT, add_special_tokens=False))
        pool.load_weights(new.state_dict(), 1)
        results = {str((t, k, p)): trainer_gaps(new, prompt, pool.generate([prompt], n=4, max_tokens=12, temperature=t,
                                                                          top_k=k, top_p=p, seeds=[7])[0], (t, k, p))
                   for t, k, p in SAMPLINGS}
        long_batch = long_seeded_batch(pool.generate, tok)
    finally:
        if pool is not None:
            pool.close()
        servers.stop()
    check_gaps(results)
    check_long_batch(*long_batch)


@pytest.mark.slow
def test_a_run_at_a_temperature_is_on_policy_at_k0(tmp_path):
    """`vcpo train --temperature 0.6 --top-k 20 --top-p 0.9 --max-staleness 0` on a random model: each batch is
    sampled with the weights the trainer then steps from, so the engine's log-probs and the trainer's (its step at
    0.6 over the same support) agree: every step's k3 KL is ~0, its importance weights 1 and no sampled token
    outside the trainer's support (with the log-probs before the temperature, the tokens' log-probs differ by about
    1: test_inprocess_engine_and_trainer_agree_after_a_sync)."""
    pytest.importorskip("vllm")
    tok, _, model = stale_and_new_model()
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"<s>{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(12)))
    folder = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "vcpo.trainer.cli", "train", "--model", str(tmp_path / "model"), "--data", str(data),
         "--engine", "inprocess", "--temperature", "0.6", "--top-k", "20", "--top-p", "0.9", "--max-staleness", "0",
         "--steps", "3",
         "--prompts-per-step", "2", "--responses-per-prompt", "4", "--max-new-tokens", "8", "--eval-size", "2",
         "--lr", "1e-3", "--output-dir", str(folder), "--no-progress"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in open(folder / "metrics.jsonl") if "kl_k3" in line]
    assert [r["lag"] for r in rows] == [0, 0, 0]
    for r in rows:
        assert abs(r["kl_k3"]) < 1e-7 and abs(r["mean_is_coef"] - 1) < 1e-4 and r["ess_ratio"] > 1 - 1e-6, r
        assert r["outside_support_fraction"] == 0, r
    config = json.load(open(folder / "config.json"))
    for name, value in (("temperature", 0.6), ("top_k", 20), ("top_p", 0.9)):
        assert config["settings"][name] == value and config["vcpo"][name] == value, name
