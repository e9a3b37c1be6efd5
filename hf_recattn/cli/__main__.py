"""``python -m hf_recattn.cli``: the ``hf-recattn`` command line."""

import sys

from . import main

sys.exit(main())
