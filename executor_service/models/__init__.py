"""Model shapes and code, checkpoint and GGUF loading, drafter shapes and weights."""
