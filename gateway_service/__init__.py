"""The OpenAI-compatible HTTP gateway (`specdec-gateway`): a stateless gRPC client of the executors."""
