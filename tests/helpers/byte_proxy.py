"""A byte-counting TCP proxy on loopback, to count what a server really sends.

Some servers (moto's S3) report no traffic; a proxy in front of them, with the client
pointed at the proxy, counts every byte the server sent back, headers included. Standard
library only (sockets and threads), so the loader benchmark loads it too.

    with ByteCountingProxy(("127.0.0.1", moto_port)) as proxy:
        ... endpoint_url=proxy.url ...
        proxy.sent  # bytes the server sent to the clients, all connections together
"""

from __future__ import annotations

import contextlib
import socket
import threading


class ByteCountingProxy:
    """Accepts on ``127.0.0.1:port``, opens a connection to ``target`` per client and
    copies bytes both ways, counting them. ``stop`` (or leaving the ``with`` block) closes
    the listener and every connection and waits for its threads."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sent = 0  # server -> clients
        self.received = 0  # clients -> server
        self.connections = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._stopped = False
        self._acceptor = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)

    def start(self) -> ByteCountingProxy:
        self._acceptor.start()
        return self

    def reset(self) -> None:
        with self._lock:
            self.sent = self.received = self.connections = 0

    def _accept(self) -> None:
        self._listener.settimeout(0.1)  # so that stop is seen without a connection
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # the listener was closed: stop
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._stopped:
                    client.close()
                    upstream.close()
                    return
                self.connections += 1
                self._sockets += [client, upstream]
                for src, dst, up in ((client, upstream, True), (upstream, client, False)):
                    t = threading.Thread(target=self._pipe, args=(src, dst, up), daemon=True)
                    self._threads.append(t)
                    t.start()

    def _pipe(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
                with self._lock:
                    if upstream:
                        self.received += len(data)
                    else:
                        self.sent += len(data)
        except OSError:  # a side closed (or stop closed it)
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)  # pass the end of the stream on

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        if self._acceptor.is_alive():
            self._acceptor.join(timeout=5)
        self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in threads:
            t.join(timeout=5)

    def __enter__(self) -> ByteCountingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
