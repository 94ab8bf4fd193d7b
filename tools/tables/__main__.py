"""``python -m tools.tables``, from the repository's root: see ``tools.tables``."""

import sys

from . import main

sys.exit(main())
