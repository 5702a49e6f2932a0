"""A stop request the signal handlers raise and long computations in worker threads obey.

A trainer's update runs in a worker thread (:mod:`agl_trainer.compute`). Ctrl-C or SIGTERM raises
``KeyboardInterrupt`` in the main thread only, and the interpreter then waits for executor threads before
it exits: an update of several minutes made the run deaf to SIGTERM until it finished (seen for
over 90 s on an AVX2-only CPU). :func:`install` makes both signals also set :data:`requested`, and the CPU
backend calls :func:`check` before every micro-batch, so a stop takes one micro-batch's forward/backward.
"""

from __future__ import annotations

import signal
import threading

#: set by the signal handlers of :func:`install`; read by :func:`check`
requested = threading.Event()


def check() -> None:
    """Raise ``KeyboardInterrupt`` if a stop was requested (call it between units of work)."""
    if requested.is_set():
        raise KeyboardInterrupt("stop requested")


def install() -> None:
    """SIGINT and SIGTERM: set :data:`requested` and raise ``KeyboardInterrupt`` in the main thread (call it
    from the main thread)."""
    def handler(signum, frame):
        requested.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
