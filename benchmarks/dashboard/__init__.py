"""The Grafana dashboard (docker/grafana/dashboards/scriptserve.json) over a benchmark run, drawn
as a PNG for docs/observability.md without Grafana:

    python -m benchmarks.dashboard [--seconds 90] [--out docs/images/dashboard.png]

Serves scenario A's MLP (benchmarks/models.py) with a real `python -m scriptserve serve`, has a
real Prometheus (Debian's `prometheus`) scrape its /metrics every second, and loads it with wrk
in phases: idle, 1, 8 connections, light load mixed with bad requests (404s and 400s sent with
httpx), then 32 connections. Every panel's queries are then run against Prometheus as Grafana
would run them (its variables substituted; range queries for time series, instant queries at the
end of the load for stats and bar gauges) and the dashboard is drawn from its own JSON: panels
placed by `gridPos`, series named by `legendFormat`, values in the panel's unit.
"""
