"""A Ctrl-C or a SIGTERM is never lost: one way to note a signal, for every place that needs one.

Python turns SIGINT into ``KeyboardInterrupt`` wherever the main thread happens to be (and a probe
turns SIGTERM into :class:`Terminated` the same way), and some places swallow it: a C extension's
initialisation that clears the error of an import it tried (torch's numpy probe does), a ``__del__``
or weakref callback ("Exception ignored in ..."), a library's bare ``except:``. The command then goes
on and answers as if nothing had happened (seen once in CI: an estimate interrupted while torch was
imported printed its answer and exited 0). Elsewhere the signal must not act at once: raised inside
``subprocess.Popen``, it leaves a child forked that nobody holds, so nobody kills it.

:func:`noted` is the one mechanism. While its body runs, each of the signals given is noted, and then:

- **at once** (``hold=False``): the handler that was installed still runs -- ``KeyboardInterrupt``
  from Python's own, or what an outer :func:`noted` does -- and where none was installed from Python
  (``SIG_DFL``) the signal's exception is raised (``KeyboardInterrupt``, :class:`Terminated`);
- **held** (``hold=True``): nothing else happens while the body runs.

and on leaving (``leaving``):

- ``"raise"``: a body that ends normally, or with an ordinary exception, although a signal was noted
  raises the signal's exception (a failure that follows a swallowed Ctrl-C is most likely of it: an
  import the Ctrl-C tore apart fails next). A ``KeyboardInterrupt`` of the body's own passes unchanged.
  The command's Ctrl-C (:func:`sigint_noted`) and the meta model's build.
- ``"ask"``: nothing; the body asks the :class:`Noted` it was given (``noted()``, ``.name``,
  ``.check()``) and ends as it sees fit. The probe's SIGTERM, and the cleanup that a signal must not
  cut short (:mod:`vramcal.probes.lifecycle`).
- ``"deliver"``: each signal noted is sent again once the old handlers are back, so it does then what it
  would have done had it come just after the body (a process start, :mod:`vramcal.probes.lifecycle`).

An ignored signal (``nohup``, ``cmd &`` in a script, a supervisor) stays ignored: nothing is installed for
it, so children started in the body inherit it ignored too. Handlers only, never the signal mask: a
child started in the body gets SIGINT and SIGTERM as usual (a Python handler is reset to the default at
``exec``). Main thread only: elsewhere Python installs no signal handlers, and nothing is noted.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Literal


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread while a probe runs (:func:`noted` with SIGTERM). A
    ``KeyboardInterrupt``, so that ``except Exception`` never swallows it; exit 143."""

    exit_code = 128 + signal.SIGTERM


EXCEPTIONS: dict[int, type[KeyboardInterrupt]] = {signal.SIGINT: KeyboardInterrupt, signal.SIGTERM: Terminated}


def signal_of(exc: KeyboardInterrupt) -> str:
    """The signal a ``KeyboardInterrupt`` stands for: ``SIGTERM`` for :class:`Terminated`, else ``SIGINT``."""
    return "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"


class Noted:
    """The signals noted so far, in order of arrival. Calling it says whether there was one."""

    def __init__(self) -> None:
        self.signals: list[int] = []

    def __call__(self) -> bool:
        return bool(self.signals)

    @property
    def name(self) -> str | None:
        """The first signal's name (``SIGINT``, ``SIGTERM``), None when none came."""
        return signal.Signals(self.signals[0]).name if self.signals else None

    def exception(self) -> KeyboardInterrupt:
        """The first signal's exception."""
        return EXCEPTIONS.get(self.signals[0], KeyboardInterrupt)()

    def check(self) -> None:
        """Raise the first signal's exception, if one was noted: where a body cannot trust that the
        signal's own exception got through (something swallowed it), or where it held the signal."""
        if self.signals:
            raise self.exception()


@contextlib.contextmanager
def noted(*signums: int, hold: bool = False,
          leaving: Literal["raise", "ask", "deliver"] = "raise") -> Iterator[Noted]:
    """Note each of ``signums`` while the body runs; yields the :class:`Noted`. ``hold``: whether the
    signal waits (True) or acts at once as it would have (False); ``leaving``: what a noted signal does
    when the body ends (module docstring). The old handlers come back on leaving."""
    seen = Noted()
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    old = {s: signal.getsignal(s) for s in signums}
    # an ignored signal stays ignored; None: a handler not installed from Python, that cannot be put back
    watched = [s for s in signums if old[s] not in (signal.SIG_IGN, None)]

    def note(signum, frame):
        seen.signals.append(signum)
        if hold:
            return
        if callable(old[signum]):
            old[signum](signum, frame)
        else:  # SIG_DFL: stop as usual, through the exception
            raise EXCEPTIONS.get(signum, KeyboardInterrupt)()

    for s in watched:
        signal.signal(s, note)
    try:
        yield seen
    except Exception:
        if seen() and leaving == "raise":  # the failure came after the signal (and most likely of it)
            raise seen.exception() from None
        raise
    finally:
        for s in watched:
            signal.signal(s, old[s])
        if leaving == "deliver":
            for s in dict.fromkeys(seen.signals):  # each once, in order; the first that raises ends it
                signal.raise_signal(s)
    if seen() and leaving == "raise":  # the body went on although signalled: something swallowed it
        raise seen.exception()


def sigint_noted() -> contextlib.AbstractContextManager[Noted]:
    """A command's Ctrl-C (:func:`vramcal.cli.main`, the meta model's build): noted, acting at once, and
    raising ``KeyboardInterrupt`` on leaving when something swallowed it."""
    return noted(signal.SIGINT)
