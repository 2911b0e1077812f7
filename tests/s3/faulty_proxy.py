"""A TCP proxy in front of the real S3 server that breaks connections on purpose (the tests' fault injector).

Every client connection gets its own connection to the server and two threads copying bytes.
``cut_after``: a response stream (server to client) that has passed this many bytes is cut
(both sockets closed), on at most ``cuts`` connections: a body that breaks off mid-way.
``refuse``: the first ``refuse`` requests are answered by the proxy itself with ``503 Slow
Down`` (S3's throttling answer) and never reach the server. ``strip_date``: every response's ``Date``
header is renamed (same length, so nothing else moves): a store that sends no clock. ``ranges``: the byte range of
every ranged request that passed (``Range:`` or Azure's ``x-ms-range:``), as ``(first, last)``, in arrival order.
The proxy's threads are daemon threads, and ``close()`` shuts the listening socket and every connection.
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from urllib.parse import urlparse

_SLOW_DOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: 95\r\n"
              b"Connection: close\r\n\r\n<Error><Code>SlowDown</Code><Message>Please reduce your request rate."
              b"</Message></Error>")


_DATE = re.compile(rb"(\r\n)date:", re.IGNORECASE)
_RANGE = re.compile(rb"\r\n(?:x-ms-)?range: *bytes=(\d+)-(\d+)", re.IGNORECASE)


class FaultyProxy:
    """``endpoint_url`` forwards to ``target`` (``host``, ``port``), breaking what it is told to."""

    def __init__(self, target: tuple[str, int], *, cut_after: int | None = None, cuts: int = 0,
                 refuse: int = 0, strip_date: bool = False) -> None:
        self.target, self.cut_after, self.cuts_left, self.refuse_left = target, cut_after, cuts, refuse
        self.strip_date = strip_date
        self.cut = self.refused = self.dates_stripped = 0
        self.ranges: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.endpoint_url = f"http://127.0.0.1:{self._listen.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            with self._lock:
                refuse = self.refuse_left > 0
                if refuse:
                    self.refuse_left -= 1
                    self.refused += 1
            if refuse:
                threading.Thread(target=self._slow_down, args=(client,), daemon=True).start()
                continue
            server = socket.create_connection(self.target)
            with self._lock:
                self._socks += [client, server]
                cut = self.cut_after if self.cuts_left > 0 else None
            threading.Thread(target=self._pipe, args=(client, server, None, False, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, cut, self.strip_date), daemon=True).start()

    def _slow_down(self, client: socket.socket) -> None:
        try:
            client.recv(65536)  # the request line and headers
            client.sendall(_SLOW_DOWN)
        except OSError:
            pass
        finally:
            client.close()

    def _pipe(self, src: socket.socket, dst: socket.socket, cut_after: int | None, strip_date: bool = False,
              requests: bool = False) -> None:
        passed = 0
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if requests:  # a request's headers arrive in one piece here: requests are small
                    with self._lock:
                        self.ranges += [(int(a), int(b)) for a, b in _RANGE.findall(data)]
                if strip_date:  # a header block starts a chunk here: responses are small and read whole
                    data, n = _DATE.subn(rb"\1xdat:", data)
                    with self._lock:
                        self.dates_stripped += n
                if cut_after is not None and passed + len(data) > cut_after:
                    with self._lock:
                        if self.cuts_left > 0:
                            self.cuts_left -= 1
                            self.cut += 1
                            dst.sendall(data[:max(0, cut_after - passed)])
                            break
                dst.sendall(data)
                passed += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def resumed(self) -> list[tuple[int, int]]:
        """The ranged requests that ask for the rest of an earlier one: from a byte inside it to the same last byte."""
        with self._lock:
            ranges = list(self.ranges)
        return [r for i, r in enumerate(ranges) if any(q[0] < r[0] <= q[1] and q[1] == r[1] for q in ranges[:i])]

    def close(self) -> None:
        self._listen.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.close()
            except OSError:
                pass


@contextmanager
def proxies_to(endpoint: str) -> Iterator[Callable[..., FaultyProxy]]:
    """A maker of :class:`FaultyProxy` instances in front of ``endpoint`` (``http://host:port``), called with the faults
    of each; every proxy made is closed on leaving (a test's fixture yields inside it)."""
    made: list[FaultyProxy] = []
    u = urlparse(endpoint)

    def make(**faults: object) -> FaultyProxy:
        p = FaultyProxy((u.hostname, u.port), **faults)
        made.append(p)
        return p
    try:
        yield make
    finally:
        for p in made:
            p.close()
