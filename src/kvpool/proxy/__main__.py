"""`python -m kvpool.proxy ...` — the same as `kvpool proxy ...`."""

import sys

from kvpool.proxy.app import main

if __name__ == "__main__":
    sys.exit(main())
