"""The ``cadence`` command's logging: rich lines on stderr, installed libraries' chatter held back."""

from __future__ import annotations

import logging
import os
import sysconfig

from rich.console import Console
from rich.logging import RichHandler

_CHATTY_LIBRARIES = ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3")
"""Loggers kept at WARNING unless ``--log-level debug``: their INFO lines are noise to a user."""


_INSTALLED = tuple({os.path.realpath(p) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])})


def quiet_third_party(record: logging.LogRecord) -> bool:
    """Installed libraries' records below WARNING are dropped (onnxscript's INFO lines on every
    ONNX export, ...) unless ``--log-level debug``; cadence's and the user's own code's pass."""
    if record.levelno >= logging.WARNING or record.name == "cadence" or record.name.startswith("cadence."):
        return True
    return not os.path.realpath(record.pathname).startswith(_INSTALLED)


def setup_logging(level: str, console: Console) -> None:
    """Log at ``level`` (a name, any case) to ``console`` through rich, replacing any handlers;
    above DEBUG, the chatty libraries are kept at WARNING and :func:`quiet_third_party` filters."""
    logging.basicConfig(
        level=level.upper(), format="%(message)s", datefmt="[%X]",
        handlers=[RichHandler(console=console, show_path=False, rich_tracebacks=False)], force=True,
    )
    if logging.getLogger().level > logging.DEBUG:  # object-store clients' INFO lines ("Found credentials ...")
        for name in _CHATTY_LIBRARIES:
            logging.getLogger(name).setLevel(logging.WARNING)
        for handler in logging.getLogger().handlers:
            handler.addFilter(quiet_third_party)
