"""Benchmarks of scriptserve: HTTP against hand-written FastAPI baselines, gRPC beside REST.

python -m benchmarks.http_load
python -m benchmarks.grpc_load
"""
