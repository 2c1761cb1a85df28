"""`python -m training ...` (also `scriptserve train ...` and `torchrun -m training ...`)."""

from __future__ import annotations

import sys

from training.cli import main

sys.exit(main())
