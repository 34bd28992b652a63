"""``python -m dpbench.sweep``: the same as ``dpbench sweep``."""

import sys

from dpbench.sweep import main

sys.exit(main())
