"""Training on several processes with torch.distributed: data parallel (DDP), sharded (FSDP2) and
pipeline stages, with lock-step and load-balanced shards and resharding checkpoints (DCP)."""
