"""`python -m scriptserve` is the `scriptserve` command."""

import sys

from scriptserve.server.cli import main

sys.exit(main())
