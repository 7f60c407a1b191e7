"""Generated from the .proto files beside this module by protos/generate.py; do not edit the stubs."""
