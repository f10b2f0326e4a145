"""``python -m kernelhost.cli``: the ``kernelhost`` command."""

import sys

from . import main

sys.exit(main())
