"""Signal handlers installed for a while and then restored: the one place cadence touches them.

Python lets only the main thread install handlers; elsewhere :func:`install_handlers` installs
nothing and says so (``SignalHandlers.installed`` is False), so library code run from a worker
thread never raises for it.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any, Callable, Iterable

__all__ = ["Handler", "SignalHandlers", "install_handlers", "signal_name"]

logger = logging.getLogger("cadence")

Handler = Callable[[int, FrameType | None], Any]


class SignalHandlers:
    """Handlers installed by :func:`install_handlers`; :meth:`restore` puts the previous ones back.

    Restoring twice is harmless; a context manager restores on exit.
    """

    def __init__(self, previous: dict[int, Any]) -> None:
        self._previous = previous

    @property
    def installed(self) -> bool:
        """Whether any handler was installed (False off the main thread)."""
        return bool(self._previous)

    def restore(self) -> None:
        """Put back the handlers that were in place before; idempotent."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def __enter__(self) -> SignalHandlers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.restore()


def install_handlers(signals: Iterable[int | None], handler: Handler, *, owner: str = "cadence") -> SignalHandlers:
    """Install ``handler`` for each of ``signals`` (``None`` entries, e.g. a signal this platform
    lacks, are skipped) and return what restores the previous handlers.

    Off the main thread nothing is installed and a debug line names ``owner``; a signal that
    cannot be handled here (``OSError`` / ``ValueError``) is skipped.
    """
    if threading.current_thread() is not threading.main_thread():
        logger.debug("%s: not in the main thread; signal handlers not installed", owner)
        return SignalHandlers({})
    previous: dict[int, Any] = {}
    for signum in signals:
        if signum is None or signum in previous:
            continue
        try:
            previous[signum] = signal.signal(signum, handler)
        except (OSError, ValueError):  # pragma: no cover - a signal this process may not handle
            logger.debug("%s: cannot handle signal %s here", owner, signum)
    return SignalHandlers(previous)


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``signal N`` for a number with no name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
