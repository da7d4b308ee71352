"""`python -m autoprec ...`: the command line, as the `autoprec` script runs it."""

import sys

from autoprec.tune._cli import main

sys.exit(main())
