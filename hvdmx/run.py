"""``python -m hvdmx.run``: hvdmxrun, the launcher, by its old module path.
The launcher lives in hvdmx/runner/ (launch.py has ``main``); this module
only runs it, so that scripts and docs that say ``python -m hvdmx.run`` keep
working, and the ``hvdmxrun`` console script (pyproject.toml) runs its
``main``."""
import sys

from hvdmx.runner.launch import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
