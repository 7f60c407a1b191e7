"""The gRPC shell: the servicer and its request checks, the wire conversions, the composition root (session.py)."""
