"""Attention kernels over one paged KV cache, and the torch-free capability table the selector reads.

Importing this package must not import torch: the selector service imports `kernels.capabilities`.
"""
