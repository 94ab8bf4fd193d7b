"""``python -m minillm.tables``: see ``minillm.tables``."""

import sys

from . import main

sys.exit(main())
