"""`python -m scriptserve.training ...`, also `scriptserve train ...` and `torchrun -m ...`."""

from __future__ import annotations

import sys

from scriptserve.training.cli import main

sys.exit(main())
