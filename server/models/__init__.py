"""Model lifecycle: the registry of model versions, loading and unloading, their settings and
configuration, the model repository, the management API's logic, snapshots, object stores and
TorchServe's config.properties."""
