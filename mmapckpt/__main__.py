"""``python -m mmapckpt``: the command line (see mmapckpt.cli)."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
