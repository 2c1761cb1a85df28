"""gRPC: the Open Inference Protocol and TorchServe's inference and management services."""
