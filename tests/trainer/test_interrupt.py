"""How a signal stops a run (vcpo.trainer.loop_state.Interrupt): before the steps at once, through vLLM's engine
start-up too; during the steps the first one is a request, a second one later stops at once; `vcpo train`'s exit."""

import os
import signal
import time

import pytest

from vcpo.trainer.errors import RunStopped
from vcpo.trainer.loop_state import Interrupt


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(5)  # the handler runs within this sleep; reaching its end means the signal was lost


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_engine_start_up_gets_through_vllm(signum, tmp_path):
    """vLLM's start-up handshake runs inside its zmq_socket_ctx, which catches KeyboardInterrupt: a stop raised as
    KeyboardInterrupt there was lost, and the run went on (or waited 10 minutes for the engine the signal ended)."""
    pytest.importorskip("vllm")
    import zmq
    from vllm.utils.network_utils import zmq_socket_ctx

    interrupt, started = Interrupt(), time.monotonic()
    with pytest.raises(RunStopped) as stopped, interrupt:
        with zmq_socket_ctx(f"ipc://{tmp_path}/handshake", zmq.ROUTER, bind=True):
            _signal_self(signum)
    assert stopped.value.signum == signum and str(stopped.value) == signal.Signals(signum).name
    assert time.monotonic() - started < 4
    assert signal.getsignal(signum) != interrupt._handle  # the previous handler is back


def test_during_the_steps_a_first_signal_is_a_request_and_a_later_one_stops_at_once(monkeypatch):
    monkeypatch.setattr(Interrupt, "REPEAT_S", 0.2)
    with Interrupt() as interrupt:
        interrupt.during_steps = True
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert interrupt.requested
        os.kill(os.getpid(), signal.SIGINT)  # within REPEAT_S: the same stop (a terminal and a launcher both send)
        time.sleep(0.3)
        with pytest.raises(RunStopped, match="SIGTERM"):
            _signal_self(signal.SIGTERM)


def test_vcpo_train_stopped_before_its_steps_exits_with_the_signals_code(monkeypatch, tmp_path, capsys):
    import vcpo.trainer.process_guard
    import vcpo.trainer.run
    from vcpo.trainer.cli import main

    def stopped(*args, **kwargs):
        raise RunStopped(signal.SIGTERM)

    monkeypatch.setattr(vcpo.trainer.process_guard, "guard", lambda: None)
    monkeypatch.setattr(vcpo.trainer.run, "train", stopped)
    assert main(["train", "--output-dir", str(tmp_path / "run")]) == 128 + signal.SIGTERM
    assert "vcpo train: stopped by SIGTERM" in capsys.readouterr().err
