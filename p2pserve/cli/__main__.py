"""``python -m p2pserve.cli``: the same entry point as the ``p2pserve`` script."""

import sys

from p2pserve.cli import main

sys.exit(main())
