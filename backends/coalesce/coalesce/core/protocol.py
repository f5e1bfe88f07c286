"""What clients and the backend both spell: request parameter names and how a refusal under load begins.

Imports nothing, so that ``coalesce_client`` (shipped in the same distribution) takes these
from here rather than keeping its own copies.
"""

from __future__ import annotations

from typing import Final

#: Request parameters the adaptive scheduler reads (clients set them per request).
TENANT_PARAMETER: Final = "tenant"
PRIORITY_PARAMETER: Final = "priority_level"
#: Sampling parameters of a guided (structured) generation, vLLM's names; at most one per request.
GUIDED_KEYS: Final = ("guided_json", "guided_regex", "guided_choice")
#: How every refusal under load begins: clients match it to tell a refusal (retry elsewhere or later)
#: from a failure. Keep it stable.
REFUSED_PREFIX: Final = "request refused: "
