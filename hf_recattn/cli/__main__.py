"""``python -m hf_recattn.cli``: the ``hf-recattn`` command line."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
