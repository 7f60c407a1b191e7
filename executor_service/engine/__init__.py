"""The engine: its thread and step, requests, the scheduler and the KV cache's bookkeeping."""
