"""Speculative decoding: proposers by drafting method, the verifier, the device step."""
