"""``python -m rnnkit``: the ``rnnkit`` command (rnnkit.app.cli)."""
import sys

from rnnkit.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
