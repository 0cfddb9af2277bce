"""``python -m tools.cli``: the ``diloco`` command (how a run's processes start each other)."""

import sys

from tools.cli.main import main

sys.exit(main())
