"""systemd's sd_notify protocol, without a dependency: datagrams such as ``READY=1`` sent to the
AF_UNIX socket named by $NOTIFY_SOCKET (a leading '@' means the abstract namespace).

Outside systemd (no $NOTIFY_SOCKET) every call is a no-op, so the daemon calls it freely.
"""

import os
import socket
from typing import Mapping, Optional


class Notifier:
    """Talks to the service manager. ``watchdog_interval`` is how often to send WATCHDOG=1
    (half the WatchdogSec systemd asked for), or None when no watchdog is armed for us."""

    def __init__(self, env: Optional[Mapping[str, str]] = None) -> None:
        env = os.environ if env is None else env
        self.address: Optional[str] = env.get("NOTIFY_SOCKET") or None
        self.watchdog_interval: Optional[float] = _watchdog_interval(env)
        self._sock: Optional[socket.socket] = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` lines in one datagram; False if there is nobody to tell or the
        send failed (the service manager being gone must not take the daemon down)."""
        if not self.address:
            return False
        address = self.address
        if address.startswith("@"):
            address = "\0" + address[1:]
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(assignments).encode("utf-8"), address)
            return True
        except OSError:
            return False

    def ready(self, status: Optional[str] = None) -> bool:
        return self.notify("READY=1", *(["STATUS=" + status] if status else []))

    def status(self, text: str) -> bool:
        return self.notify("STATUS=" + text.replace("\n", " "))

    def watchdog(self) -> bool:
        return self.watchdog_interval is not None and self.notify("WATCHDOG=1")

    def stopping(self, status: Optional[str] = None) -> bool:
        return self.notify("STOPPING=1", *(["STATUS=" + status] if status else []))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _watchdog_interval(env: Mapping[str, str]) -> Optional[float]:
    """Half of $WATCHDOG_USEC, if it is meant for this process ($WATCHDOG_PID unset or ours)."""
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec:
        return None
    try:
        if pid and int(pid) != os.getpid():
            return None
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None
