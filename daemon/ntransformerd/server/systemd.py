"""sd_notify and logging: the two things ntransformerd tells systemd.

Uses systemd-python (`systemd.daemon`, `systemd.journal`) when it is installed; otherwise writes
the notify datagram itself and logs to stderr with syslog priority prefixes, which the journal
also understands. Off systemd (no NOTIFY_SOCKET) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

log = logging.getLogger("ntransformerd")


class Notifier:
    """READY=1, STATUS=, WATCHDOG=1 and STOPPING=1 to $NOTIFY_SOCKET. Thread-safe."""

    def __init__(self, environ=os.environ):
        self.address = environ.get("NOTIFY_SOCKET") or None
        usec = environ.get("WATCHDOG_USEC")
        pid = environ.get("WATCHDOG_PID")
        on = usec and usec.isdigit() and (not pid or pid == str(os.getpid()))
        self.watchdog_interval = int(usec) / 1e6 if on else None
        self._last_watchdog = 0.0
        self._lock = threading.Lock()
        self._sd = None
        if environ is os.environ:  # systemd.daemon reads the process environment itself
            try:
                from systemd import daemon as sd_daemon  # lazy: optional (the [daemon] extra)
                self._sd = sd_daemon
            except ImportError:
                pass

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, message: str) -> bool:
        if not self.address:
            return False
        with self._lock:
            if self._sd is not None:
                return bool(self._sd.notify(message))
            addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                    s.sendto(message.encode(), addr)
                return True
            except OSError as e:
                log.warning("sd_notify to %s failed: %s", self.address, e)
                return False

    def ready(self, status: str) -> None:
        self.notify(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")

    def status(self, text: str) -> None:
        self.notify(f"STATUS={text}")

    def stopping(self, status: str = "stopping") -> None:
        self.notify(f"STOPPING=1\nSTATUS={status}")

    def watchdog(self) -> None:
        """Called from the scheduler loop each iteration: a stuck loop stops the pings."""
        if self.watchdog_interval is None:
            return
        now = time.monotonic()
        if now - self._last_watchdog >= self.watchdog_interval / 4:
            self._last_watchdog = now
            self.notify("WATCHDOG=1")


class _SyslogPrefix(logging.Formatter):
    """`<6>message`: journald reads the prefix as the priority of a stderr line."""

    PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def format(self, record):
        return f"<{self.PRIORITY.get(record.levelno, 6)}>{super().format(record)}"


def _stderr_is_journal(environ) -> bool:
    stream = environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stderr.fileno())
        return stream == f"{st.st_dev}:{st.st_ino}"
    except (OSError, ValueError):
        return False


def setup_logging(level: str = "info", environ=os.environ) -> str:
    """Log to the journal (with fields) under systemd, else to stderr. Returns where."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.setLevel(level.upper())
    logging.getLogger("grpc").setLevel(logging.WARNING)
    if _stderr_is_journal(environ):
        try:
            from systemd import journal  # lazy: optional (the [daemon] extra)
            root.addHandler(journal.JournalHandler(SYSLOG_IDENTIFIER="ntransformerd"))
            return "journal"
        except ImportError:
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(_SyslogPrefix("%(message)s"))
            root.addHandler(h)
            return "journal-stderr"
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(asctime)s ntransformerd %(levelname)s %(message)s"))
    root.addHandler(h)
    return "stderr"
