"""``python -m coalesce_tools.gateway``: the same as ``coalesce gateway``."""

import sys

from coalesce_tools.gateway.server import main

sys.exit(main())
