"""The rollout engines (docs/scale.md): what the training loop asks of one (interface.Engine), vLLM owned by the run
in this process or its own (rollout_engine), a pool of vLLM servers (pool; local ones: servers; weights over NCCL:
weight_transfer), and the one place an engine is built from the settings (start)."""
