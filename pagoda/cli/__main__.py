"""`python -m pagoda.cli ...`: the same as the `pagoda` entry point."""

import sys

from pagoda.cli import main

sys.exit(main())
