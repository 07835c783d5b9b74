"""``python -m cukit`` runs the ``cukit`` command."""

import sys

from cukit.cli import main

sys.exit(main())
