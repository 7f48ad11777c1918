"""What the training loop asks of a rollout engine, and what the engines share: the completions they return, the
log-probs they report, the weights they are sent.

The loop never asks which engine it has: `engine` process and inprocess are a RolloutEngine (rollout_engine.py),
`engine` server a ServerPool (pool.py); tests stand in a fake one (tests/support/fake_engine.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence

from ..config import ENGINE_MODES

OWNED_MODES = tuple(m for m in ENGINE_MODES if m != "server")  # vLLM owned by the run: in its own processes, or here
# the sampled tokens' log-probs under the distribution sampled from (after the temperature), not the raw logits'
# (vLLM's default, raw_logprobs); docs/trainer.md, "Sampling settings"
LOGPROBS_MODE = "processed_logprobs"


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # log mu(token) under the engine's weights, one per token
    finish_reason: Optional[str]
    # engine: server only: (policy version, first token, end) spans of the weights that produced the tokens,
    # and the server's URL
    versions: Optional[list[tuple[int, int, int]]] = None
    server: Optional[str] = None


class GenerationAborted(RuntimeError):
    """Engine.abort() ended the generation (the run is stopping)."""


class TransferError(RuntimeError):
    """A server's NCCL weight transfer failed and was stopped (weight_transfer.py); handled as a failed reload."""


class Engine(ABC):
    """A rollout engine: generates from the prompts' token ids with the behaviour log-probs, takes new weights,
    and reports on itself. `generate` and `load_weights` may be called from the rollout threads while the loop runs."""

    concurrent_sync = False  # True: load_weights may run while a batch is generated (else between batches)

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, max_tokens: int, temperature: float,
                 top_k: int = -1, top_p: float = 1.0, seeds: Optional[Sequence[int]] = None,
                 stop_token_ids: Sequence[int] = ()) -> list[list[Completion]]:
        """n completions of each prompt (token ids). `seeds[i]` makes prompt i's completions reproducible (the
        j-th seeded with seeds[i] + j). temperature 0 is greedy; top_k and top_p are vLLM's (off: -1 or 0, and 1),
        and the log-probs are those of the truncated distribution."""

    @abstractmethod
    def load_weights(self, state: dict, version: int) -> None:
        """Replace the engine's weights by `state`, the policy's `version` (Hugging Face parameter names, CPU
        tensors not modified while this runs); with LoRA, `state` is the adapter."""

    def metrics(self, rollouts: Sequence) -> dict:
        """What the engine adds to the metrics.jsonl line of the step that consumed `rollouts`."""
        return {}

    def summary(self) -> dict:
        """What the engine adds to the run's summary.json."""
        return {}

    def abort(self) -> None:
        """End the generation in flight (GenerationAborted in its thread) and refuse the ones after: the run is
        stopping."""
        self.close()

    @abstractmethod
    def close(self) -> None:
        """Free what the engine holds (the engine's processes, the pool's connections)."""


def unique_tensors(state: dict) -> dict:
    """The state dict without the second name of a shared tensor (a tied LM head): safetensors refuses shared
    storage, and vLLM ties the head itself."""
    seen, out = set(), {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out[name] = t
    return out
