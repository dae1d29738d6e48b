"""A small key-value store with ``torch.distributed.Store``'s interface, over TCP on
127.0.0.1, for the rendezvous tests (torch is not needed).

``KVServer`` runs in the test process (a thread per client connection); ``KVStore`` is a
client: ``set``, ``get`` (blocks until the key exists, at most the store's ``timeout``, then
raises ``TimeoutError`` as torch's stores raise their ``DistStoreError``), ``check``,
``wait``, ``delete_key``, ``add``, ``num_keys``, ``timeout``. A client reconnects lazily in a
forked child, so one made before ``fork()`` is usable after it.
"""

from __future__ import annotations

import os
import pickle
import socket
import socketserver
import struct
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union


def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj)
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the store connection closed")
        out += chunk
    return bytes(out)


def _recv(sock: socket.socket) -> Any:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    return pickle.loads(_recv_exact(sock, n))


class KVServer:
    """The server: a dict and a condition variable; ``close()`` stops it."""

    def __init__(self) -> None:
        self.data: Dict[str, bytes] = {}
        self.changed = threading.Condition()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                while True:
                    try:
                        op, args = _recv(self.request)
                    except (ConnectionError, OSError, struct.error):
                        return
                    try:
                        reply = ("ok", outer.apply(op, args))
                    except Exception as e:  # reported to the client, raised there
                        reply = ("err", type(e).__name__, str(e))
                    _send(self.request, reply)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.address: Tuple[str, int] = self.server.server_address[:2]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def apply(self, op: str, args: Tuple[Any, ...]) -> Any:
        with self.changed:
            if op == "set":
                key, value = args
                self.data[key] = value
                self.changed.notify_all()
                return None
            if op == "wait":  # keys, seconds: True once all exist, False at the deadline
                keys, seconds = args
                deadline = time.monotonic() + seconds
                while not all(k in self.data for k in keys):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self.changed.wait(left)
                return True
            if op == "get":
                return self.data[args[0]]
            if op == "check":
                return all(k in self.data for k in args[0])
            if op == "delete":
                return self.data.pop(args[0], None) is not None
            if op == "add":
                key, amount = args
                value = int(self.data.get(key, b"0")) + amount
                self.data[key] = str(value).encode()
                self.changed.notify_all()
                return value
            if op == "num_keys":
                return len(self.data)
        raise ValueError(f"unknown operation {op!r}")

    def keys(self) -> List[str]:
        with self.changed:
            return sorted(self.data)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class KVStore:
    """A client with ``torch.distributed.Store``'s methods (thread-safe: one lock per call)."""

    def __init__(self, address: Tuple[str, int], timeout: timedelta = timedelta(seconds=60)) -> None:
        self.address = address
        self._timeout = timeout
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._pid = -1

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            if self._sock is None or self._pid != os.getpid():
                self._sock = socket.create_connection(self.address, timeout=120)
                self._pid = os.getpid()
            _send(self._sock, (op, args))
            reply = _recv(self._sock)
        if reply[0] == "ok":
            return reply[1]
        raise RuntimeError(f"store {op}: {reply[1]}: {reply[2]}")

    @staticmethod
    def _bytes(value: Union[bytes, bytearray, str]) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key: str, value: Union[bytes, bytearray, str]) -> None:
        self._call("set", key, self._bytes(value))

    def wait(self, keys: Sequence[str], timeout: Optional[timedelta] = None) -> None:
        seconds = (timeout or self._timeout).total_seconds()
        if not self._call("wait", list(keys), seconds):
            raise TimeoutError(f"Wait timeout after {seconds}s for keys {list(keys)}")

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._call("get", key)

    def check(self, keys: Sequence[str]) -> bool:
        return self._call("check", list(keys))

    def delete_key(self, key: str) -> bool:
        return self._call("delete", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def num_keys(self) -> int:
        return self._call("num_keys")
