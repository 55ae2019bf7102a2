"""The benchmark entry point without installing the command: ``python benchmarks/run.py --help``.

Same as ``rnnkit bench`` and ``python -m rnnkit.bench``; the harness is rnnkit.bench.
"""
import sys

from rnnkit.bench import main

if __name__ == "__main__":
    sys.exit(main())
