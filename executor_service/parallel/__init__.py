"""Tensor parallelism of the target over torch.distributed: sharding (layers.py), rank 0's calls (driver.py),
the followers (worker.py, launcher.py) and the messages between them (protocol.py). See docs/parallelism.md."""
