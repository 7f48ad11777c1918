"""`vcpo train` with faults injected, for the tests that kill, starve and poison a run:
`python tests/support/faulty_train.py FAULTS_JSON ARGS...` runs `vcpo train ARGS...` in this process after patching
in the faults FAULTS_JSON names (its keys, each optional):

- "fake_engine": {"poison": P, "seconds": S}: tests/support/fake_engine.FakeEngine generates the rollouts (no vLLM),
  each batch taking S seconds, the responses of prompts whose sampling seed is a multiple of P (0: none) with a
  behaviour log-prob of -inf;
- "slow_sync": PATH: each weight sync into the fake engine creates PATH and waits 1 s before the engine takes the
  weights (a SIGKILL sent when PATH appears lands in the middle of the sync);
- "slow_commit": PATH: each checkpoint, once written and before it is synced and renamed into place, creates PATH
  and waits 1 s (a SIGKILL sent when PATH appears lands in the middle of the checkpoint);
- "disk_full_at_step": N: from the checkpoint of step N on, no file of the process may grow past 256 KiB
  (RLIMIT_FSIZE; SIGXFSZ ignored), so the real writers of the checkpoint (safetensors, torch.save) fail with
  EFBIG, as they would on a full disk with ENOSPC (the logs of this short run stay smaller);
- "kill_server_mid_sync": {"version": V, "run_dir": RUN}: the sync of version V SIGKILLs the pool's first server
  (its process group, from RUN/servers/servers.json) after pausing it and before it reloads the weights (with LoRA:
  before it loads the adapter)."""

import json
import os
import signal
import sys
import time
from contextlib import contextmanager

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # `support` from tests/


def fake_engine(poison: int = 0, seconds: float = 0.0) -> None:
    from support.fake_engine import FakeEngine
    from vcpo.trainer import run

    @contextmanager
    def start_engine(cfg, **kwargs):
        yield FakeEngine(poison=poison or False, seconds=seconds), 0.0

    run.start_engine = start_engine


def slow_sync(marker: str) -> None:
    from support.fake_engine import FakeEngine

    load_weights = FakeEngine.load_weights

    def announced(self, state, version):
        open(marker, "w").close()
        time.sleep(1.0)
        load_weights(self, state, version)

    FakeEngine.load_weights = announced


def slow_commit(marker: str) -> None:
    from vcpo.trainer import run_folder

    fsync_tree = run_folder._fsync_tree

    def announced(root):
        open(marker, "w").close()
        time.sleep(1.0)
        fsync_tree(root)

    run_folder._fsync_tree = announced


def disk_full_at_step(step: int) -> None:
    from support.file_limits import limit_file_size
    from vcpo.trainer.run_folder import RunFolder

    new_checkpoint = RunFolder.new_checkpoint

    def limited(self, at):
        if at == step:
            limit_file_size(256 * 1024)  # for the rest of the process
        return new_checkpoint(self, at)

    RunFolder.new_checkpoint = limited


def kill_server_mid_sync(version: int, run_dir: str) -> None:
    from vcpo.trainer.engines.pool import ServerPool

    reload, take_weights, load_adapter = ServerPool._reload, ServerPool._take_weights, ServerPool._load_adapter
    syncing = {}

    def kill(s):
        servers = json.load(open(os.path.join(run_dir, "servers", "servers.json")))
        pid = next(x["pid"] for x in servers if x["url"] == s.url)
        print(f"faulty_train: SIGKILL to server {s.url} (pid {pid}) during the sync of version {version}", flush=True)
        os.killpg(pid, signal.SIGKILL)

    async def _reload(self, s, v):
        syncing[s.url] = v
        return await reload(self, s, v)

    async def _take_weights(self, s):
        if syncing.get(s.url) == version and s is self.servers[0]:
            kill(s)
        return await take_weights(self, s)

    async def _load_adapter(self, s, name, folder):
        if name == f"vcpo-v{version}" and s is self.servers[0]:
            kill(s)
        return await load_adapter(self, s, name, folder)

    ServerPool._reload, ServerPool._take_weights, ServerPool._load_adapter = _reload, _take_weights, _load_adapter


if __name__ == "__main__":
    faults = json.loads(sys.argv[1])
    for name, value in faults.items():
        if isinstance(value, dict):
            {"fake_engine": fake_engine, "kill_server_mid_sync": kill_server_mid_sync}[name](**value)
        else:
            {"slow_commit": slow_commit, "slow_sync": slow_sync, "disk_full_at_step": disk_full_at_step}[name](value)
    from vcpo.trainer.cli import main

    sys.exit(main(["train", *sys.argv[2:]]))
