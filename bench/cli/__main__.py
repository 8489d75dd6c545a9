"""`python -m bench.cli`: the same as `lrq-bench`."""

import sys

from bench.cli import main

sys.exit(main())
