"""What runs inside a worker: the handler API, model backends and built-in handlers."""
