"""The training module: real data to served archives.

`scriptserve train --model lenet --epochs 10 --out model_store` (or `python -m
scriptserve.training ...`) trains on scikit-learn's handwritten digits, exports TorchScript / ONNX
(/ int8), and writes one archive per format, served by the built-in `image_classifier` handler.
`torchrun --nproc_per_node=2 -m scriptserve.training ...` trains with DistributedDataParallel,
or with FSDP2 (`--strategy fsdp`: each rank holds a shard of the model; sharded checkpoints).
Nothing imports this package; it uses `scriptserve.archiver` to write archives. See
docs/training.md.
"""
