"""The rollout engine: a real vLLM `LLM`, generating n responses per prompt with the sampled tokens' log-probs
(the behaviour log-probs of the loss), and taking new weights while it runs.

Two modes:
- "process": vLLM's engine core runs in its own processes, bound to `engine_cores` on a CPU machine; new
  weights travel through a safetensors file that the engine reloads from disk.
- "inprocess": the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); new weights are handed over
  as tensors. It starts in seconds (the tests use it) but shares this process's cores with the trainer.
With `lora` (a LoRA run, vcpo/trainer/lora.py) the engine serves the base model with vLLM's LoRA support, and new
weights are an adapter: written as an adapter folder, registered under a new LoRA id, named by every request."""

from __future__ import annotations

import os
import shutil
import threading
from typing import Optional, Sequence

import torch

from ..lora import engine_max_rank, write_adapter
from .interface import LOGPROBS_MODE, OWNED_MODES, Completion, Engine, GenerationAborted, unique_tensors


def _set_engine_env(mode: str, kv_cache_gib: float, engine_cores: Optional[str]) -> None:
    # vLLM reads these when the engine starts; VLLM_CPU_KVCACHE_SPACE otherwise reserves most of the RAM.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if mode == "process" else "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(round(kv_cache_gib))))
    if engine_cores is not None and mode == "process":
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = engine_cores
    # vLLM warns at every weight reload that the rotary embedding's cache is not in the checkpoint (it is not
    # a weight); keep its errors, set VLLM_LOGGING_LEVEL to see more
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def unsplit_prefill(max_model_len: int) -> dict:
    """vLLM settings that keep each prompt's prefill in one engine step, on vLLM's CPU build only: there a seeded
    request whose prompt is prefilled over two steps crashes the engine ("CPU Generator does not use offset": vLLM
    rewinds the request's generator after the partial step, which only a CUDA generator can), and any batch of more
    prompt tokens than a step's budget (4096 by default) is split. Chunked prefill off, a budget of a whole prompt
    or more. Nothing on other platforms, where splitting long prompts keeps decoding smooth."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(4096, max_model_len)}


class RolloutEngine(Engine):
    """engine: process and inprocess. Weights are loaded between batches, by the thread that generates."""

    def __init__(self, model_path: str, *, mode: str = "process", dtype: str = "float32",
                 max_model_len: int = 2048, kv_cache_gib: float = 1.0, seed: int = 0,
                 engine_cores: Optional[str] = None, sync_dir: Optional[str] = None,
                 gpu_memory_utilization: float = 0.5, lora: Optional[dict] = None) -> None:
        if mode not in OWNED_MODES:
            raise ValueError(f"engine must be one of {list(OWNED_MODES)}, got {mode!r}")
        if (mode == "process" or lora is not None) and sync_dir is None:
            raise ValueError("engine='process' and LoRA need a sync_dir for the weight files")
        self.mode, self.sync_dir = mode, sync_dir
        self.lora, self.adapter = lora, None  # the adapter config; the LoRARequest every request names
        self._aborted = threading.Event()
        _set_engine_env(mode, kv_cache_gib, engine_cores)
        from vllm import LLM

        lora_options = {} if lora is None else {"enable_lora": True, "max_loras": 1,
                                                "max_lora_rank": engine_max_rank(lora["r"])}
        # prefix caching off: cached prompt KV computed with old weights would outlive a weight sync
        self.llm = LLM(model=model_path, dtype=dtype, enforce_eager=True, max_model_len=max_model_len, seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=False,
                       logprobs_mode=LOGPROBS_MODE, use_tqdm_on_load=False, **unsplit_prefill(max_model_len),
                       **lora_options)

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, max_tokens: int, temperature: float,
                 top_k: int = -1, top_p: float = 1.0, seeds: Optional[Sequence[int]] = None,
                 stop_token_ids: Sequence[int] = ()) -> list[list[Completion]]:
        """n completions of each prompt (token ids). `seeds[i]` makes prompt i's completions reproducible
        (vLLM seeds its j-th completion with seeds[i] + j). temperature 0 is greedy."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(n=n, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens,
                                 logprobs=0,
                                 seed=None if seeds is None else int(seeds[i]),
                                 stop_token_ids=list(stop_token_ids), detokenize=False)
                  for i in range(len(prompts))]
        # LLM.generate's loop, with a look at abort() between engine steps, in the thread that steps the engine (the
        # engine is not to be driven from two threads)
        requests = self.llm.enqueue([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    use_tqdm=False, lora_request=self.adapter)
        engine, outs = self.llm.llm_engine, []
        while engine.has_unfinished_requests():
            if self._aborted.is_set():
                engine.abort_request(requests, internal=True)
                raise GenerationAborted("the rollout engine was stopped during a generation")
            outs += [out for out in engine.step() if out.finished]
        outs.sort(key=lambda out: int(out.request_id))  # the prompts' order, as LLM.generate sorts them
        result = []
        for out in outs:
            completions = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                # logprobs=0 returns the sampled token's own entry at each position
                lps = [float(pos[tok].logprob) for pos, tok in zip(c.logprobs, ids)]
                completions.append(Completion(ids, lps, c.finish_reason))
            result.append(completions)
        return result

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Replace the engine's weights by `state`, the policy's `version` (Hugging Face parameter names, CPU
        tensors not modified while this runs); with LoRA, `state` is the adapter."""
        if self.lora is not None:
            folder = os.path.join(self.sync_dir, f"adapter-v{version}")
            write_adapter(folder, state, self.lora)
            self.use_adapter(folder, version)
            return
        state = unique_tensors(state)
        if self.mode == "inprocess":
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
            return
        from safetensors.torch import save_file

        os.makedirs(self.sync_dir, exist_ok=True)
        tmp = os.path.join(self.sync_dir, "model.safetensors.tmp")
        save_file({k: v.contiguous() for k, v in state.items()}, tmp)
        os.replace(tmp, os.path.join(self.sync_dir, "model.safetensors"))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self.sync_dir})

    def use_adapter(self, folder: str, version: int) -> None:
        """LoRA: the adapter folder `folder` (version `version`) from now on, loaded now; the previous one is
        dropped from the engine (and its folder deleted when it was a sync's)."""
        from vllm.lora.request import LoRARequest

        previous, self.adapter = self.adapter, LoRARequest(f"vcpo-v{version}", version + 1, folder)
        self.llm.llm_engine.add_lora(self.adapter)
        if previous is not None and previous.lora_int_id != self.adapter.lora_int_id:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            if os.path.dirname(previous.lora_path) == self.sync_dir and previous.lora_path != folder:
                shutil.rmtree(previous.lora_path, ignore_errors=True)

    def abort(self) -> None:
        """End the generation in flight (GenerationAborted in its thread, within one engine step) and refuse the
        ones after: the run is stopping."""
        self._aborted.set()

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None),
                                                                      "shutdown", None)
            if shutdown is not None:
                shutdown()
            del llm
