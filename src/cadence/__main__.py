"""``python -m cadence`` is the ``cadence`` command."""

import sys

from cadence.cli.main import main

sys.exit(main())
