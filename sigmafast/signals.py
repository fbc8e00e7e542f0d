"""Signal handling of the trainer: the first SIGINT/SIGTERM checkpoints and stops, a second exits."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Callable, Optional

log = logging.getLogger("sigmafast.train")


class StopRequest:
    """SIGINT/SIGTERM handlers, restored on exit: the first signal (logged once) asks the loop to
    checkpoint and stop; a second SIGINT or SIGTERM exits at once (KeyboardInterrupt / SystemExit)."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: Optional[int] = None  # the first signal's number
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            log.warning("second signal (%s): exiting now, without a checkpoint", name)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.requested, self.signum = True, signum
        log.warning("%s received: saving a checkpoint and stopping (send it again to exit at once)", name)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class EvaluationStopped(Exception):
    """Raised by the evaluation loops when their ``should_stop()`` turns true: the evaluation is abandoned and
    its partial results are discarded."""


def check_stop(should_stop: Optional[Callable[[], bool]]) -> None:
    """Raise :class:`EvaluationStopped` when ``should_stop`` is given and returns true (a host-side flag read,
    no device sync)."""
    if should_stop is not None and should_stop():
        raise EvaluationStopped
