"""cadence.runtime.signals: handlers installed, restored, and nothing installed off the main thread."""

from __future__ import annotations

import os
import signal
import threading

from cadence.runtime.signals import install_handlers, signal_name


def test_install_and_restore_puts_the_previous_handlers_back() -> None:
    seen: list[int] = []
    before = signal.getsignal(signal.SIGUSR1)
    with install_handlers([signal.SIGUSR1, None, signal.SIGUSR1], lambda s, f: seen.append(s)) as handlers:
        assert handlers.installed
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
    assert signal.getsignal(signal.SIGUSR1) == before
    handlers.restore()  # idempotent
    assert signal.getsignal(signal.SIGUSR1) == before


def test_off_the_main_thread_nothing_is_installed() -> None:
    result: list = []
    before = signal.getsignal(signal.SIGUSR2)
    thread = threading.Thread(target=lambda: result.append(install_handlers([signal.SIGUSR2], lambda s, f: None)))
    thread.start()
    thread.join()
    assert not result[0].installed
    assert signal.getsignal(signal.SIGUSR2) == before


def test_signal_name() -> None:
    assert signal_name(signal.SIGTERM) == "SIGTERM"
    assert signal_name(999) == "signal 999"
