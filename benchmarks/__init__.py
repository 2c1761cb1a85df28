"""HTTP benchmarks of scriptserve against hand-written FastAPI baselines.

python -m benchmarks.http_load
"""
