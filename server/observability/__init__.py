"""Observability: the access log, tracing, Prometheus metrics and gauges, statistics and the log
format (profiling captures are model operations: `server/models/profiling.py`)."""
