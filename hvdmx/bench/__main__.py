"""``python -m hvdmx.bench``: see hvdmx/bench/__init__.py."""
import sys

from hvdmx.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
