"""The error of a bad configuration value, shared by every layer that checks a config.

:class:`ConfigError` lives here, below the layers that raise it (``ft.config`` checks the
``ft`` group, ``cli`` the rest), so that none of them imports the command line for it.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and what is allowed."""
