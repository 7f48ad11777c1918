"""Where a run's parts go: the trainer ranks and rank 0's messages to them (ranks), FSDP2 over them (fsdp), the cores
and GPUs of one machine (devices). Below the loop and the engines, which use them; Ray's launcher of the ranks is
above the loop (vcpo/trainer/ray_launch.py), its server actors are among the engines (engines/ray_servers.py)."""
