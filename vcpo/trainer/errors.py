"""The errors a run ends with that are not bugs: `vcpo train` and `vcpo eval` print them as `error: ...` and exit 1
(CLI_ERRORS). Each message says what happened and how to go on (most often: fix X, then `vcpo train --resume`)."""

import signal

# defined in rewards.py: a reward worker process loads that file alone, outside this package
from .rewards import RewardError


class EngineUnavailable(RuntimeError):
    """Every server of the pool is down."""


class WeightSyncError(RuntimeError):
    """A server that is up could not take new weights (say, a model of another architecture)."""


class ServerStartError(RuntimeError):
    """A local vLLM server exited or did not become healthy while starting."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (a full disk, a quota, a file system gone read-only)."""


class NonFiniteError(RuntimeError):
    """Training cannot go on with finite weights: too many steps in a row were skipped (the checkpoint of the last
    finite state is written first), or the weights are not finite (nothing of them was published or saved)."""


class TrainerRankDied(RuntimeError):
    """A trainer rank's Ray actor died (killed, out of memory, its node lost)."""


class RunStopped(BaseException):
    """A signal's immediate stop (loop_state.Interrupt): `vcpo train` exits 128 + the signal's number, not 1. Not
    KeyboardInterrupt: vLLM's engine start-up swallows that (its `zmq_socket_ctx` catches it), which left a run
    stopped during start-up running on, or, when the same signal ended the engine, waiting 10 minutes for it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    def __reduce__(self):  # rebuilt from its signal's number (a Ray rank actor returns it to the driver)
        return RunStopped, (self.signum,)


CLI_ERRORS = (EngineUnavailable, WeightSyncError, ServerStartError, RewardError, CheckpointError, NonFiniteError,
              TrainerRankDied)
