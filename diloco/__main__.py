"""``python -m diloco``: the ``diloco`` command (how a run's processes start each other)."""

import sys

from diloco.command import main

sys.exit(main())
