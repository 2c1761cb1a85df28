"""Wire formats, shared by the REST and gRPC adapters: tensors (Open Inference Protocol typed
values and raw bytes), the OIP JSON body with its binary extension, and TorchServe's
prediction payloads. Every check on what a client sent lives here once; the adapters only move
bytes between their transport and these functions."""
