"""Attention backend selection, torch-free: a pure function of a SelectBackendsRequest (rules R1-R11:
docs/selection.md). The selector service serves it over gRPC; the executor runs it in-process when it has no
selector address."""
