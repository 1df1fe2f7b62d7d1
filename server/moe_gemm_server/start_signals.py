"""SIGINT and SIGTERM from the first line of `moe-gemm-server` until uvicorn takes them over.

Before uvicorn captures the signals (`uvicorn.Server.capture_signals`, once its event loop
runs), a signal met Python's defaults: SIGINT a KeyboardInterrupt traceback from wherever the
start was (importing torch, building the engine), or, landing while asyncio's runner held
SIGINT, a cancellation that could be lost (the server then started and served on); SIGTERM
killed the process. The start takes about a second, so a supervisor stopping a server just
started, or a Ctrl-C, met one of these. Owned here instead:

- while the server is being set up (`setting_up`): a signal ends the process at once, with
  one line and status 0 (`stop_now`): nothing has been served, so nothing is lost. Raised as
  an exception instead (as KeyboardInterrupt is), it would land wherever the start is, often
  inside code that cannot pass it on: a finalizer or an import lock's callback prints it as
  "Exception ignored in ..." with a traceback, and the import of a C extension (numpy's,
  which torch's C code imports and whose failure it swallows) is left half done, so that the
  next import of it fails with a traceback and status 1, or the process aborts or hangs;
- from the call that starts the event loop until uvicorn captures the signals (`holding`): a
  signal is only remembered, and `take()` hands it to the server, which then stops without
  serving (an exception raised inside the event loop's own code would leave it half-run);
- once uvicorn has let go of them again (`serving`): a signal, such as one uvicorn passes on
  as it returns (it raises again a second one, "stop at once"), ends the process at once as
  the signal's default action does (status 128 + the signal), without a traceback, as
  SIGTERM's default did.

Standard library only: it is installed before the server's heavy imports run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import NoReturn

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_now(sig: int) -> NoReturn:
    """End the process at once, status 0, with one line saying why: a signal before the
    server served (no exception, no exit hook: see the module docstring)."""
    try:
        sys.stdout.flush()
        sys.stderr.write(f"moe-gemm-server: received {signal.Signals(sig).name} while "
                         "starting; stopped before serving\n")
        sys.stderr.flush()
    finally:
        os._exit(0)


class StartSignals:
    """The process's SIGINT and SIGTERM while `installed()`: see the module docstring."""

    def __init__(self) -> None:
        self.state = "setting_up"
        self.pending: list[int] = []  # received while `holding`, not yet taken

    def _handle(self, sig: int, frame: FrameType | None) -> None:
        if self.state == "serving":
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)
            return
        if self.state == "holding":
            self.pending.append(sig)
            return
        stop_now(sig)

    def hold(self) -> None:
        """From now on (the event loop is about to start) a signal is remembered, not
        raised."""
        self.state = "holding"

    def take(self) -> list[int]:
        """The signals received while holding (uvicorn has just captured the signals)."""
        taken, self.pending = self.pending, []
        self.state = "serving"
        return taken

    @contextlib.contextmanager
    def installed(self) -> Iterator[StartSignals]:
        """Own the signals for the block (the main thread only: elsewhere signal.signal
        cannot be called, and no signal is delivered there), then put the previous handlers
        back."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
        for sig in SIGNALS:
            signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
