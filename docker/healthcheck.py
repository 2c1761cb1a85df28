"""Container health check: exit 0 when the server's liveness endpoint answers 200.

Reads the same settings as the server (config file and SCRIPTSERVE_* variables), so it follows
a changed inference address; a wildcard address is checked on loopback. Liveness needs no key.
"""

from __future__ import annotations

import sys
import urllib.request

from scriptserve.server.settings import load_settings, parse_address

WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def main() -> int:
    host, port = parse_address(load_settings().inference_address)
    host = WILDCARDS.get(host, host)
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        with urllib.request.urlopen(f"http://{netloc}/v2/health/live", timeout=4) as answer:
            return 0 if answer.status == 200 else 1
    except OSError as exc:
        sys.stderr.write(f"liveness check failed: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
