"""``python -m fastpersist``: the ``fastpersist`` command line."""

import sys

from .cli import main

sys.exit(main())
