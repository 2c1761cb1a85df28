"""FastAPI apps: inference (TorchServe + Open Inference Protocol v2), management, metrics."""
