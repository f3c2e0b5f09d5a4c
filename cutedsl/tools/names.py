"""DeepSeek V4 tensor names between the native and HF schemes: the runtime module
`cutedsl.names`, under the tools' namespace (the tools and their users import either)."""

from __future__ import annotations

from cutedsl.names import *  # noqa: F403
from cutedsl.names import __all__  # noqa: F401
