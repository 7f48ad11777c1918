"""SmolLM2-135M-Instruct (a real pretrained model, tests/support/real_model.py) through the trainer's parts: after
a weight sync the in-process vLLM engine's sampled-token log-probs are the trainer's (k3 KL and mean importance
weight, with stated tolerances, and the same check against the stale weights to show it can fail); and
`vcpo train --model PATH.gguf` with LoRA on a server pool, in bf16 mixed precision, sampling with top-p and top-k
(only the adapter synced), then `vcpo eval` on its checkpoint; and on 2 FSDP2 ranks in bf16 mixed precision."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from support.real_model import smollm2_folder, smollm2_gguf

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow  # a real pretrained model in vLLM and in the trainer

# after a sync: the worst token's |trainer - engine| log-prob, the k3 KL estimate and |mean IS weight - 1|
MAX_TOKEN_GAP, MAX_K3, MAX_WEIGHT_GAP = 1e-3, 1e-6, 1e-4

SYNC_CHECK = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vcpo import VCPOConfig
    from vcpo.step import RolloutBatch, _Pass
    from vcpo.trainer.engines.rollout_engine import RolloutEngine
    from vcpo.trainer.rollouts import Rollout, pad_rollouts

    folder = sys.argv[1]
    tok = AutoTokenizer.from_pretrained(folder)
    old = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # the trainer's next version: a small step away from the engine's weights
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.02 * p.std())
    engine = RolloutEngine(folder, mode="inprocess", max_model_len=256)
    engine.load_weights({k: v.clone() for k, v in new.state_dict().items()}, 1)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 23 + 19?"}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    completions = engine.generate([prompt], n=4, max_tokens=24, temperature=1.0, seeds=[7])[0]
    engine.close()
    rollouts = [Rollout(batch=0, prompt_index=0, response_index=j, prompt_ids=list(prompt),
                        response_ids=c.token_ids, behavior_logp=c.logprobs, finish_reason=c.finish_reason,
                        reward=0.0, version=1) for j, c in enumerate(completions)]
    ids, attn, loss_mask, mu = pad_rollouts(rollouts, pad_id=0)
    batch = RolloutBatch(ids, attn, loss_mask, mu, torch.zeros(len(rollouts)))
    mask = loss_mask[:, 1:] != 0
    result = {"tokens": int(mask.sum())}
    for name, model in (("synced", new), ("stale", old)):
        with torch.no_grad():
            lp = _Pass(model, batch, VCPOConfig(), norms=False, keep=False, bookkeeping=False).logp
        d = (lp - mu[:, 1:]).double()[mask]  # log of the importance weight pi / mu per token
        result[name] = {"max_gap": d.abs().max().item(), "k3": (d.exp() - 1 - d).mean().item(),
                        "mean_weight": d.exp().mean().item()}
    print(json.dumps(result))
""")


def test_engine_and_trainer_logprobs_agree_after_a_sync(tmp_path):
    folder = smollm2_folder()
    script = tmp_path / "check.py"
    script.write_text("if __name__ == '__main__':\n" + textwrap.indent(SYNC_CHECK, "    "))
    proc = subprocess.run([sys.executable, str(script), folder], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(result)
    synced, stale = result["synced"], result["stale"]
    assert result["tokens"] >= 16
    assert synced["max_gap"] < MAX_TOKEN_GAP and synced["k3"] < MAX_K3, synced
    assert abs(synced["mean_weight"] - 1) < MAX_WEIGHT_GAP, synced
    assert stale["k3"] > 100 * max(synced["k3"], 1e-9), (stale, synced)  # the check tells the weights apart


def test_lora_run_from_the_gguf_file_then_eval(tmp_path):
    """Two asynchronous LoRA steps (rank 16) on the real model from its GGUF file, with the math reward and its
    chat template, the trainer in bf16-mixed, the rollouts sampled with top-p 0.9 and top-k 50 by a local vLLM
    server that loads each adapter by name; then `vcpo eval` on the run: the adapter alone reached the engine, the
    trainer's log-probs are of the engine's truncated distribution (K3 KL at the fp32-engine / bf16-mixed level of
    bench/RESULTS.md, "Precision", not the untruncated one's), and the evaluation scored the checkpoint."""
    data = tmp_path / "add.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}? Put the answer in \\\\boxed{{}}.",
                                        "answer": str(a + b)}) + "\n" for a in range(11, 31) for b in (19, 47)))
    folder = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def vcpo(*argv):
        proc = subprocess.run([sys.executable, "-m", "vcpo.trainer.cli", *map(str, argv)], env=env, capture_output=True,
                              text=True, timeout=1200)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return proc.stdout + proc.stderr

    vcpo("train", "--model", smollm2_gguf(), "--data", data, "--reward", "math", "--lora-rank", "16", "--steps", 2,
         "--prompts-per-step", 2, "--responses-per-prompt", 4, "--max-new-tokens", 24, "--eval-size", 8,
         "--eval-every", 0, "--checkpoint-every", 1, "--max-staleness", 1, "--engine", "server", "--engine-servers", 1,
         "--precision", "bf16-mixed", "--top-p", "0.9", "--top-k", "50", "--no-progress", "--output-dir", folder)
    rows = [json.loads(line) for line in open(folder / "metrics.jsonl") if line.strip()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # bf16-mixed over an fp32 engine: K3 7.7e-4 a token measured (untruncated log-probs: far more)
        assert r["kl_k3"] < 5e-3 and r["outside_support_fraction"] < 0.05, r
    config = json.load(open(folder / "config.json"))
    assert config["vcpo"]["autocast"] == "bfloat16" and (config["vcpo"]["top_k"], config["vcpo"]["top_p"]) == (50, 0.9)
    assert json.load(open(folder / "summary.json"))["sync_bytes"] > 0
    summary = json.load(open(folder / "summary.json"))
    assert summary["steps"] == 2 and 0 <= summary["final_eval"]["accuracy"] <= 1
    checkpoint = folder / "checkpoints" / "step-000002"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    vcpo("eval", "--model", folder, "--n", 0, "--max-new-tokens", 24)
    result = json.load(open(checkpoint / "eval-heldout.json"))
    assert result["prompts"] == 8 and 0 <= result["greedy"]["accuracy"] <= 1
    samples = result["greedy"]["samples"]  # the scored responses beside the score
    assert len(samples) == 8 and all(s["response"] and s["reward"] in (0.0, 1.0) for s in samples)


def test_fsdp2_bf16_mixed_run_from_the_gguf_file(tmp_path):
    """Two steps of the real model on 2 FSDP2 ranks in bf16-mixed (bf16 units gathered, fp32 shards and
    reductions), with a length reward so that every step has a gradient: the steps are taken, the engine/trainer
    K3 KL at k = 0 and the ESS are those of bf16 numerics (bench/RESULTS.md, "Precision"), and the checkpoint's
    weights and AdamW state are fp32."""
    import torch
    from safetensors import safe_open

    data = tmp_path / "add.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                            for a in range(11, 31) for b in (19, 47)))
    (tmp_path / "length_reward.py").write_text("def score(response, answer):\n    return len(response) / 50\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    folder = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "vcpo.trainer.cli", "train", "--model", smollm2_gguf(), "--data", str(data),
         "--reward", "length_reward:score", "--steps", "2", "--prompts-per-step", "2", "--responses-per-prompt", "4",
         "--max-new-tokens", "16", "--eval-size", "4", "--eval-every", "0", "--checkpoint-every", "2",
         "--max-staleness", "0", "--engine", "process", "--trainer-ranks", "2", "--fsdp", "--precision",
         "bf16-mixed", "--no-progress", "--output-dir", str(folder)], env=env, capture_output=True, text=True,
        timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in open(folder / "metrics.jsonl") if line.strip()]
    assert [r["step"] for r in rows] == [1, 2]
    # FSDP2's bf16 units round every weight, norms and embeddings too: K3 measured 1e-3 to 1.6e-2 a token. A
    # sequence's log-weight variance is about 2 x K3 x its length (16 tokens), so the ESS ratio of 8 sequences is
    # about exp(-0.5) at the top of that range: measured 0.76 on one CPU, above 0.8 on another.
    for r in rows:
        assert not r["skipped"] and r["grad_norm"] > 0 and 0 < r["kl_k3"] < 5e-2 and r["ess_ratio"] > 0.5, r
    checkpoint = folder / "checkpoints" / "step-000002"
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]
    assert {s["exp_avg"].dtype for s in state.values()} == {torch.float32}
