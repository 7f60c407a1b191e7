"""The model runner: one target pass over a step's tokens, CUDA graphs."""
