"""Sampling: the target distribution, penalties, logprobs, sampling settings as tensors."""
