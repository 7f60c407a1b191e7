"""specdec wire types: the Python stubs generated from protos/specdec/v1 (see protos/generate.py)."""
