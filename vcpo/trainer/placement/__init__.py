"""Where a run's parts go, above the loop: the trainer ranks and rank 0's messages to them (ranks), FSDP2 over them
(fsdp), the cores and GPUs of one machine (devices), and Ray's placement group of ranks and servers (ray_launch,
ray_servers)."""
