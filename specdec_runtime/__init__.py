"""What both specdec gRPC services share, torch-free: errors with their gRPC status, request size bounds, server
flags / TLS / auth / health / metrics (grpc_runtime), client channels, structured logs.

Neither service is imported from here, so the selector and the executor each depend on this package alone.
"""
