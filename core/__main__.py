"""``python -m wasinn``: the ``wasinn`` command (see :mod:`wasinn.cli`)."""

import sys

from wasinn.cli import main

sys.exit(main())
