"""`python -m benchmarks.gpu_check` (see the package)."""

from benchmarks.gpu_check.cli import main

raise SystemExit(main())
