"""``python -m coalesce_tools.gateway``: the same as ``coalesce gateway``."""

import sys

from coalesce_tools.gateway.server import main

if __name__ == "__main__":
    sys.exit(main())
