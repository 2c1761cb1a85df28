"""A rolling restart behind a real load balancer, under steady load, on loopback: does any
request fail, and how far does throughput dip?

    apt-get install -y haproxy
    python -m benchmarks.rollout [--replicas 2] [--seconds-per-phase 6] [--connections 16]

N replicas serve the scenario-A MLP archive (benchmarks/models.py), each with one worker so that
two fit two cores, behind haproxy (Debian's package, run in the foreground as a child) that
checks `/v2/health/ready`. A closed-loop client sends the scenario's request through haproxy
from a fixed number of workers and records every request's outcome: succeeded (200), failed
(any other status) or unanswered (a timeout or a connection error). After a warm phase and a
steady phase, each replica in turn gets SIGTERM, exits, is started again on the same ports and
waited for until haproxy marks it UP, followed by another steady phase.

Prints the per-second throughput, the steady throughput before the first restart, the lowest
1-s window during each restart (the dip), the counts, and writes them all to
benchmarks/results/rollout-<date>.json. Exits 1 when any request failed or went unanswered.
"""
