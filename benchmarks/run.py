"""The benchmark entry point without installing the command: ``python benchmarks/run.py --help``.

Same as ``rnnkit bench`` and ``python -m rnnkit.app.bench``; the harness is rnnkit.app.bench.
"""
import sys

from rnnkit.app.bench import main

if __name__ == "__main__":
    sys.exit(main())
