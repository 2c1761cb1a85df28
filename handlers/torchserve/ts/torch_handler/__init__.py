"""`ts.torch_handler`: TorchServe's base handler and built-in handlers."""
