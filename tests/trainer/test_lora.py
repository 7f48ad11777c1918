"""LoRA training (`vcpo train --lora-rank`, docs/trainer.md "LoRA"): exact per-sequence norms over the adapter
against a brute-force loop in float64; the engine's log-probs after an adapter sync against the trainer's; a LoRA
run end to end (adapter sync at every step, checkpoints of the adapter, --resume, vcpo export, vcpo eval)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

peft = pytest.importorskip("peft")

from vcpo.trainer import lora  # noqa: E402
from vcpo.trainer.lora import adapters_in_flight  # noqa: E402
from vcpo.trainer.config import make_config  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _tiny_llama(dtype=torch.float64):
    """The support tiny Llama at this file's size: hidden 64 in 4 heads, vocab 97."""
    from support.tiny_models import tiny_llama

    return tiny_llama(dtype=dtype, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=97)


def _logp(model, ids, attention):
    from vcpo.step import token_logp

    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    return token_logp(logits[:, :-1], ids[:, 1:]) * attention[:, 1:]


@pytest.mark.parametrize("targets, dropout", [("all-linear", 0.0), ("q_proj,v_proj,down_proj", 0.2)])
def test_adapter_norms_match_a_brute_force_loop(targets, dropout):
    """PerSequenceGradients over a peft model: the norms are over the adapter's factors alone (the frozen base
    layers are not recorded), exactly those of one backward per sequence, dropout in front of lora_A included."""
    from peft import LoraConfig, get_peft_model

    from vcpo.grad_norms import PerSequenceGradients

    model = get_peft_model(_tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=lora.targets(targets),
                                                     lora_dropout=dropout))
    with torch.no_grad():  # B starts at 0: the gradient of A would vanish and hide a wrong rule for it
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 97, (3, 9), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 6:] = 0
    attention[2, 4:] = 0
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    torch.manual_seed(5)  # the same dropout masks in both forwards
    logp = _logp(model, ids, attention)
    want = torch.stack([sum(g.pow(2).sum() for g in torch.autograd.grad(logp[i].sum(), params, retain_graph=True))
                        for i in range(3)])
    torch.manual_seed(5)
    with PerSequenceGradients(model, num_seqs=3) as psg:
        psg.backward(_logp(model, ids, attention).sum())
    got = psg.sq_norms()
    assert torch.allclose(got, want, rtol=1e-10, atol=0), (got, want)
    recorded = {type(r.module).__name__ for r in psg._records}
    assert recorded == {"Linear"} and all(r.module.weight.requires_grad for r in psg._records)
    assert len(psg._records) == len(params)  # one per adapter factor: no base layer is recorded


def test_step_updates_only_the_adapter():
    import vcpo

    model = lora.wrap(_tiny_llama(torch.float32), 4, 8.0, "all-linear")
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ids = torch.randint(1, 97, (4, 8), generator=torch.Generator().manual_seed(2))
    attention, loss_mask = torch.ones_like(ids), torch.ones_like(ids)
    loss_mask[:, :3] = 0
    with torch.no_grad():
        behaviour = _logp(model, ids, attention).detach()
    batch = vcpo.RolloutBatch(ids, attention, loss_mask, torch.nn.functional.pad(behaviour, (1, 0)),
                              torch.tensor([1.0, 0.0, 0.5, 0.0]), group_index=torch.tensor([0, 0, 1, 1]), num_groups=2)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    vcpo.step(model, optimizer, batch, vcpo.VCPOConfig())
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert any(p.abs().max() > 0 for n, p in model.named_parameters() if "lora_B" in n)  # the adapter moved


@pytest.mark.parametrize("bad, match", [
    ({"lora_rank": 0}, "lora_rank must be an integer from 1 to 512"),
    ({"lora_rank": 600}, "lora_rank must be an integer from 1 to 512"),
    ({"lora_rank": 8, "lora_alpha": -1.0}, "lora_alpha must be a finite number > 0"),
    ({"lora_alpha": 16.0}, "settings of LoRA: add --lora-rank"),
    ({"lora_rank": 8, "lora_targets": " ,"}, "lora_targets must be all-linear or module names"),
    ({"lora_rank": 8, "engine": "server", "engine_urls": "http://127.0.0.1:8000", "weight_swap": "keep"},
     "leave weight_swap at wait"),
    ({"lora_rank": 8, "vcpo": {"fused_lm_head": True}}, "fused_lm_head false"),
])
def test_bad_lora_settings_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        make_config(**bad)


def test_an_adapter_on_a_server_pool_travels_as_files():
    # checked here without a GPU: the config refuses nccl first on a machine that has none
    with pytest.raises(ValueError, match="the adapter travels as files"):
        lora.check_settings(8, None, "all-linear", engine="server", fused_lm_head=False,
                            weight_transfer="nccl", weight_swap="wait")
    from vcpo.trainer.engines.pool import ServerPool

    with pytest.raises(ValueError, match="travels as files"):
        ServerPool(["http://127.0.0.1:9"], weights_dir="/tmp/w", weight_transfer="nccl", lora={"r": 8})
    assert lora.server_args(16, 4) == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "6"]


def test_fresh_adapters_depend_on_the_seed_alone():
    """A run's adapters are the same whatever drew random numbers before (each trainer rank, a 1-rank run)."""
    def factors(seed, draws):
        torch.manual_seed(123)
        torch.rand(draws)
        model = lora.wrap(_tiny_llama(torch.float32), 4, 8.0, "all-linear", seed=seed)
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}

    first, later, other = factors(0, 1), factors(0, 1000), factors(1, 1)
    assert first.keys() == later.keys() and all(torch.equal(first[n], later[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in first)


def test_the_engine_rank_and_targets():
    assert [lora.engine_max_rank(r) for r in (1, 2, 8, 9, 16, 500)] == [1, 8, 8, 16, 16, 512]
    assert make_config(lora_rank=8).resolved_lora_alpha() == 16.0
    with pytest.raises(ValueError, match="lora_targets 'nothing_here'"):
        lora.wrap(_tiny_llama(torch.float32), 4, 8.0, "nothing_here")


# -- with vLLM -------------------------------------------------------------------------------------------------------
# Run after the training runs, in one process (vLLM imported once): the export against the adapter model, vcpo eval
# on the run, then the engine's log-probs against the trainer's around an adapter sync (a fresh adapter on the base).
AFTER_RUN = textwrap.dedent("""
    import json, os, sys, torch
    from transformers import AutoModelForCausalLM
    from vcpo.trainer import lora, tiny
    from vcpo.trainer.engines.rollout_engine import RolloutEngine
    from vcpo.trainer.evaluate import run_eval
    from vcpo.trainer.export import export
    run, out, model_dir, sync_dir = sys.argv[1:5]
    checkpoint = export(run, out)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    policy = lora.load_policy(checkpoint, 8, 16.0, "all-linear").eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(1, 20, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b, c = merged(ids).logits, policy(input_ids=ids).logits, base(ids).logits
    result = {"merged_vs_adapter": (a - b).abs().max().item(), "merged_vs_base": (a - c).abs().max().item(),
              "eval": run_eval(run, n=0)["greedy"]}

    policy = lora.load_policy(model_dir, 8, 16.0, "all-linear").eval()
    engine = RolloutEngine(model_dir, mode="inprocess", max_model_len=64, sync_dir=sync_dir,
                           lora=lora.adapter_config(policy))
    prompt = [tiny.BOS] + tiny.build_tokenizer().encode("12+34=")

    def gap():
        # largest |engine - trainer| log-prob over the tokens of 4 sampled continuations, and their count
        worst, count = 0.0, 0
        for c in engine.generate([prompt], n=4, max_tokens=12, temperature=1.0, seeds=[7])[0]:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                lp = torch.log_softmax(policy(input_ids=ids).logits[0, :-1].float(), -1)
            mine = lp.gather(-1, ids[0, 1:, None])[len(prompt) - 1:, 0]
            worst = max(worst, (mine - torch.tensor(c.logprobs)).abs().max().item())
            count += len(c.token_ids)
        return worst, count

    def perturb():
        with torch.no_grad():
            for p in policy.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p), alpha=0.3)

    perturb()
    engine.load_weights(lora.adapter_state(policy), 0)
    first, _ = gap()
    perturb()
    stale, _ = gap()
    engine.load_weights(lora.adapter_state(policy), 1)
    synced, n = gap()
    sent = sum(os.path.getsize(os.path.join(sync_dir, "adapter-v1", f)) for f in os.listdir(sync_dir + "/adapter-v1"))
    result["sync"] = {"first": first, "stale": stale, "synced": synced, "tokens": n, "bytes": sent,
                      "model_bytes": os.path.getsize(os.path.join(model_dir, "model.safetensors")),
                      "old_folder_left": os.path.exists(os.path.join(sync_dir, "adapter-v0"))}
    engine.close()
    print(json.dumps(result))
""")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run on a tiny random model with a length reward (gradients from step 1), synchronous (k = 0):
    engine: process for 4 steps, then --resume with engine: inprocess for 2 more, then with engine: server (2 local
    servers, the first SIGKILLed as the adapter of version 7 is loaded) for 2 more; then AFTER_RUN."""
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("lora")
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": f"{tmp}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code = ("import sys\nfrom vcpo.trainer import tiny\ntok = tiny.build_tokenizer()\n"
            "tiny.build_model(tiny.TinyRecipe(), len(tok)).save_pretrained(sys.argv[1])\n"
            "tok.save_pretrained(sys.argv[1])")
    model = tmp / "model"
    subprocess.run([sys.executable, "-c", code, str(model)], check=True, env=env, timeout=300)
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"<s>{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(40)))
    (tmp / "length_reward.py").write_text("def score(response, answer):\n    return len(response) / 8.0\n")
    folder = tmp / "run"
    common = ["--no-progress", "--output-dir", str(folder)]

    def python(argv):
        proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return proc.stdout

    python(["-m", "vcpo.trainer.cli", "train", "--model", str(model), "--data", str(data), "--reward", "length_reward:score",
            "--engine", "process", "--steps", "4", "--prompts-per-step", "4", "--responses-per-prompt", "4",
            "--max-new-tokens", "6", "--eval-size", "8", "--eval-every", "100", "--checkpoint-every", "2",
            "--max-staleness", "0", "--loss", "grpo", "--lr", "2e-2", "--lora-rank", "8", *common])
    python(["-m", "vcpo.trainer.cli", "train", "--resume", str(folder), "--steps", "6", "--engine", "inprocess", *common])
    fault = json.dumps({"kill_server_mid_sync": {"version": 7, "run_dir": str(folder)}})
    server_run = python([os.path.join(HERE, "..", "support", "faulty_train.py"), fault, "--resume", str(folder),
                         "--steps", "8", "--engine", "server", "--engine-servers", "2", *common])
    script = tmp / "after_run.py"
    script.write_text("if __name__ == '__main__':\n" + textwrap.indent(AFTER_RUN, "    "))
    out = python([str(script), str(folder), str(tmp / "export"), str(model), str(tmp / "sync")])
    return {"folder": folder, "model": model, "export": tmp / "export", "server_run": server_run,
            "result": json.loads(out.strip().splitlines()[-1])}


@pytest.mark.slow
def test_lora_run_end_to_end(lora_run):
    """Every batch is sampled by the engine with the adapter of the step before, so the K3 KL of behaviour and
    policy stays 0 (a sync that did not reach the engine would leave it on an older adapter), on the server pool too,
    after one of its two servers died while it loaded an adapter; checkpoints hold the adapter and its optimizer;
    the resumed runs continue the steps; the pool keeps the adapters in flight and removes the older ones."""
    folder = lora_run["folder"]
    rows = [json.loads(line) for line in open(folder / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert all(abs(r["kl_k3"]) < 1e-5 for r in rows)  # behaviour = the trainer's policy at every step
    assert rows[-1]["grad_norm"] > 0
    assert [r.get("servers_up") for r in rows[6:]] == [2, 1]  # the kill came as version 7 was loaded
    assert "faulty_train: SIGKILL to server" in lora_run["server_run"] and "is down" in lora_run["server_run"]
    adapters = sorted(p.name for p in (folder / ".weights").iterdir() if p.name.startswith("adapter-v"))
    assert len(adapters) <= adapters_in_flight(0) and "adapter-v8" in adapters or "adapter-v7" in adapters
    checkpoint = folder / "checkpoints" / "step-000008"
    assert sorted(p.name for p in checkpoint.iterdir() if "safetensors" in p.name) == ["adapter_model.safetensors"]
    adapter = lora.read_adapter_config(str(checkpoint))
    assert adapter["r"] == 8 and adapter["lora_alpha"] == 16.0
    assert adapter["base_model_name_or_path"] == str(lora_run["model"])
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=False)
    from safetensors.torch import load_file

    tensors = load_file(checkpoint / "adapter_model.safetensors")
    assert len(optimizer["state"]) == len(tensors)  # AdamW over the adapter's factors, nothing else
    assert max(t.abs().max() for k, t in tensors.items() if "lora_B" in k) > 0  # it trained


@pytest.mark.slow
def test_export_loads_in_transformers_and_vcpo_eval_runs_the_adapter(lora_run):
    result = lora_run["result"]
    # fp32 rounding of W + (alpha / r) B A only: a wrong merge (a scale, a factor left out) is off by the adapter's
    # whole effect, the difference from the base model
    assert result["merged_vs_adapter"] < 1e-3 * result["merged_vs_base"]
    assert set(os.listdir(lora_run["export"])) >= {"config.json", "model.safetensors", "tokenizer.json"}
    final = json.load(open(lora_run["folder"] / "summary.json"))["final_eval"]
    assert (result["eval"]["accuracy"], result["eval"]["reward"]) == (final["accuracy"], final["reward"])


@pytest.mark.slow
def test_adapter_sync_gives_the_trainers_logprobs(lora_run):
    sync = lora_run["result"]["sync"]
    assert sync["tokens"] >= 8
    assert sync["first"] < 1e-4  # the engine serves base + the trainer's adapter...
    assert sync["stale"] > 1e-2  # ...the trainer's adapter moved: the engine is off...
    assert sync["synced"] < 1e-4  # ...until the sync (fp32)
    assert sync["bytes"] < sync["model_bytes"] / 2 and not sync["old_folder_left"]
