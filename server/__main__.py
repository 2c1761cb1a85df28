"""`python -m server` is the `scriptserve` command."""

import sys

from server.cli import main

sys.exit(main())
