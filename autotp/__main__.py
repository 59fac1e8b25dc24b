"""``python -m autotp``."""

import sys

from autotp.cli import main

sys.exit(main())
