"""The error of a bad configuration value, shared by every layer that checks a config.

:class:`ConfigError` lives here, below the layers that raise it (``ft.config`` checks the
``ft`` group, ``cli`` the rest), so that none of them imports the command line for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ConfigError", "config_errors"]


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and what is allowed."""


@contextmanager
def config_errors() -> Iterator[None]:
    """Within it, a ``ValueError`` of a check (:mod:`easgd_lightning.utils.checks`) is
    re-raised as a :class:`ConfigError` with the same one line."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from None
