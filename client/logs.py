"""Where log records go: a file always, the terminal only with --verbose.

hivemind's background tasks (in the DHT and averager processes, which inherit this
set-up when they are forked) report failures as log records and as asyncio's
"Task exception was never retrieved" tracebacks. A volunteer's terminal shows
none of them: they go, with their tracebacks, to ``WORKDIR/logs/swarm-client.log``,
and to stderr as well with ``--verbose``. What the volunteer must know reaches
them as one plain line from the client itself.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
from pathlib import Path

MAX_LOG_BYTES = 64 << 20  # a log file larger than this is started afresh
FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"
_forks_routed = False


class _LogStream(io.TextIOBase):
    """A stderr for forked helpers: what they print (multiprocessing's "Process DHT-1:" traceback when one
    dies at shutdown, say) becomes log records rather than lines on the volunteer's terminal."""

    def __init__(self, logger: logging.Logger):
        self._logger, self._pending = logger, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            if line.strip():
                self._logger.debug(line)
        return len(text)


def _route_child_stderr() -> None:
    sys.stderr = _LogStream(logging.getLogger("swarm.child"))


def setup_logging(log_file: Path | None, verbose: bool) -> None:
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")  # hivemind's records propagate to the root logger, configured here
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.DEBUG)
    formatter = logging.Formatter(FORMAT)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        try:
            if log_file.stat().st_size > MAX_LOG_BYTES:
                log_file.unlink()
        except OSError:
            pass
        file_handler = logging.FileHandler(log_file, encoding="utf-8")
        file_handler.setLevel(logging.DEBUG)
        file_handler.setFormatter(formatter)
        root.addHandler(file_handler)
    if verbose:
        stream = logging.StreamHandler(sys.stderr)
        stream.setLevel(logging.INFO)
        stream.setFormatter(formatter)
        root.addHandler(stream)
    if not root.handlers:
        root.addHandler(logging.NullHandler())  # and not logging's last-resort handler, which prints to stderr
    logging.getLogger("hivemind").setLevel(logging.DEBUG if verbose else logging.INFO)
    for noisy in ("asyncio", "urllib3", "filelock", "fsspec", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.INFO)
    # datasets prints its records through its own stderr handler: at INFO a volunteer saw "Using custom data
    # configuration ..." on the terminal, twice per peer, and a broken file printed the reader's error before
    # the client's own line about it. Its warnings and errors go to the log file like everyone else's.
    import datasets.utils.logging  # noqa: F401 - it adds that handler when imported: remove it after

    library = logging.getLogger("datasets")
    for handler in list(library.handlers):
        library.removeHandler(handler)
    library.propagate = True
    library.setLevel(logging.WARNING)
    logging.captureWarnings(True)
    os.environ.setdefault("GOLOG_LOG_LEVEL", "info" if verbose else "fatal")  # p2pd's own logs

    def thread_excepthook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        logging.getLogger("swarm.threads").error(
            "uncaught exception in thread %s",
            args.thread.name if args.thread else "?",
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
        )

    threading.excepthook = thread_excepthook
    global _forks_routed
    if not _forks_routed:
        os.register_at_fork(after_in_child=_route_child_stderr)
        _forks_routed = True
