"""``python -m mmapckpt``: the command line (see mmapckpt/tools/cli.py)."""

import sys

if __name__ == "__main__":
    try:
        from .tools.cli import main
    except KeyboardInterrupt:  # Ctrl-C while starting: one line, no traceback, as main() does later
        print("mmapckpt: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
