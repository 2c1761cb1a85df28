"""Observability: the access log, tracing, Prometheus metrics and gauges, statistics, profiling
and the log format."""
