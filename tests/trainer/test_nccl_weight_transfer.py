"""`weight_transfer: nccl` on a GPU machine: one local vLLM server started with vLLM's NCCL engine on GPU 1, the
weights of a tiny model sent from the trainer's GPU 0 twice; after each sync the server's sampled log-probs
match a float32 recompute with the weights just sent (and not the ones before).

Needs two CUDA GPUs (NCCL puts no two ranks of a group on one GPU) and the CUDA build of vLLM; skipped
elsewhere. Built to vLLM 0.32's API and not yet run on a GPU (docs/scale.md)."""

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]  # two GPUs and a vLLM server
pytest.importorskip("vllm")
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("weight_transfer nccl needs 2 CUDA GPUs: the trainer's and the server's",
                allow_module_level=True)

from support.tiny_models import logprobs, save_tiny_model  # noqa: E402

from vcpo.trainer import tiny  # noqa: E402


def test_nccl_sync_reaches_the_server_and_its_logprobs_match(tmp_path):
    from transformers import AutoModelForCausalLM

    from vcpo.trainer.engines.pool import ServerPool
    from vcpo.trainer.engines.servers import LocalServers

    tok = tiny.build_tokenizer()
    folder = save_tiny_model(tmp_path / "model")  # the server starts from these weights
    models = [AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32) for _ in range(3)]
    torch.manual_seed(1)
    with torch.no_grad():  # versions 1 and 2: far from each other, so a token under the wrong weights shows
        for p0, p1, p2 in zip(*(m.parameters() for m in models)):
            p1.copy_(p0 + 0.3 * torch.randn_like(p0))
            p2.copy_(p0 + 0.3 * torch.randn_like(p0))
    servers = LocalServers(folder, 1, log_dir=str(tmp_path / "logs"), dtype="float32", max_model_len=64,
                           kv_cache_gib=1, seed=0, gpus=["1"], gpu_memory_utilization=0.3, weight_transfer="nccl")
    urls = servers.start()
    torch.cuda.set_device(0)
    pool = ServerPool(urls, weights_dir=str(tmp_path / "unused"), weight_transfer="nccl",
                      device=torch.device("cuda", 0))
    try:
        pool.check(setting="engine_servers", probe_text="12+34=", max_model_len=64,
                   probe_ids=tok.encode("12+34=", add_special_tokens=False))
        prompt = [tiny.BOS] + tok.encode("12+34=")
        for version in (1, 2):
            # as Policy.weights() hands them over: a CPU copy
            pool.load_weights({k: v.detach().clone() for k, v in models[version].state_dict().items()}, version)
            out = [c for group in pool.generate([prompt] * 4, n=4, max_tokens=24, temperature=1.0, seeds=range(4))
                   for c in group]
            assert all(c.versions == [(version, 0, len(c.token_ids))] and c.token_ids for c in out)
            errors = [(logprobs(models[v], prompt, c.token_ids) - torch.tensor(c.logprobs)).abs().max()
                      for c in out for v in (version, version - 1)]
            # GPU float32 kernels (TF32 matmuls where vLLM allows them): 2e-3; the weights before are far off
            assert max(errors[0::2]) < 2e-3 and max(errors[1::2]) > 5e-2, errors
        assert len(pool.servers[0].reload_seconds) == 2 and pool.stats.write_seconds == 0
        assert not os.path.exists(tmp_path / "unused")  # nothing went through storage
    finally:
        pool.close()
        servers.stop()
