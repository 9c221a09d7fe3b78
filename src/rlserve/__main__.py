"""`python -m rlserve` is `rlserve`."""

import sys

from rlserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
