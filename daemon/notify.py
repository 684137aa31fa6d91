"""sd_notify: tell systemd about readiness, reloads, status and watchdog pings.

The protocol is one datagram per message to the AF_UNIX socket named by $NOTIFY_SOCKET, holding
newline-separated KEY=VALUE pairs. It is stable and small enough to reimplement here rather than
depend on python-systemd (a C extension that needs libsystemd headers to build).

Outside systemd (no $NOTIFY_SOCKET) every call is a no-op, so the daemon calls these
unconditionally. Sending never raises: losing a STATUS line must not take the daemon down.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping

from control.logs import get_logger

_LOGGER_NAME = "adaspec.notify"
# A datagram to systemd is queued at once unless its queue is full; bounded so that a stuck
# manager cannot stall the event loop for long.
_SEND_TIMEOUT_S = 1.0


def socket_address(value: str | None) -> str | None:
    """The address to send to for a $NOTIFY_SOCKET value, or None when notifications are off.

    "/path" is a filesystem socket, "@name" an abstract one (the "@" stands for a leading NUL).
    Anything else is ignored, as sd_notify does.
    """
    if not value:
        return None
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between watchdog pings (half of $WATCHDOG_USEC), or None when there is no watchdog.

    $WATCHDOG_PID, when set, names the process the watchdog is meant for: a child that inherited
    the environment must not ping on its parent's behalf.
    """
    env = os.environ if environ is None else environ
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 2 / 1_000_000


def _format_value(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    # Each field is one line of the datagram; a newline inside a value would start a bogus field.
    return str(value).replace("\r", " ").replace("\n", " ")


class Notifier:
    """A handle on the service manager's notification socket.

    `address` overrides $NOTIFY_SOCKET (same syntax); "" switches notifications off. The
    environment is read once, at construction. Safe to use from several threads.
    """

    def __init__(self, address: str | None = None) -> None:
        raw = os.environ.get("NOTIFY_SOCKET") if address is None else address
        self._address = socket_address(raw)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._failing = False
        if raw and self._address is None:
            get_logger(_LOGGER_NAME).warning(
                "ignoring NOTIFY_SOCKET: not an absolute path or @abstract name", notify_socket=raw
            )

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def ready(self) -> bool:
        return self.send(READY=1)

    def reloading(self) -> bool:
        # systemd (Type=notify-reload) waits for a timestamp newer than the reload request;
        # without MONOTONIC_USEC `systemctl reload` hangs until it times out.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send(RELOADING=1, MONOTONIC_USEC=usec)

    def status(self, text: str) -> bool:
        return self.send(STATUS=text)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def stopping(self) -> bool:
        return self.send(STOPPING=1)

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for `seconds` more before systemd's start/stop timeout fires (from now, not added)."""
        return self.send(EXTEND_TIMEOUT_USEC=max(0, int(seconds * 1_000_000)))

    def watchdog_interval(self) -> float | None:
        """Half the watchdog period in seconds, or None without a watchdog or a notify socket."""
        return watchdog_interval() if self.enabled else None

    def send(self, **fields: object) -> bool:
        """Send the fields as one message; True when it was delivered.

        Names are upper-cased (`send(status="x")` sends STATUS=x); True and False become 1 and 0.
        """
        if self._address is None or not fields:
            return False
        message = "\n".join(f"{key.upper()}={_format_value(value)}" for key, value in fields.items())
        data = message.encode("utf-8")
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                    self._sock.settimeout(_SEND_TIMEOUT_S)
                self._sock.sendto(data, self._address)
            except OSError as exc:
                # Log the first failure of a run only: a vanished socket would otherwise log on
                # every watchdog ping.
                if not self._failing:
                    self._failing = True
                    get_logger(_LOGGER_NAME).warning(
                        "sd_notify failed", address=self._address.replace("\0", "@"), error=str(exc)
                    )
                return False
            if self._failing:
                self._failing = False
                get_logger(_LOGGER_NAME).info("sd_notify works again")
            return True

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
