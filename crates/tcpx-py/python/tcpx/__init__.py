"""tcpx: move GPU or host memory between machines over GPUDirect-TCPX (or kernel TCP).

Two layers over one native engine (``tcpx-runtime``, whose threads never touch Python):

* this module, the Pythonic layer: :class:`Endpoint`, :class:`Connection`,
  :class:`Region`, :class:`Transfer`; numpy arrays, buffers and torch tensors (CPU and
  CUDA) accepted directly, without copies; failures raise :class:`Error` subclasses;
* :mod:`tcpx.p2p`: UCCL's ``p2p.Endpoint`` API (integer ids, raw pointers, ``ok`` flags),
  so that ``from uccl import p2p`` scripts run with ``from tcpx import p2p``.

Example::

    import numpy as np, tcpx
    with tcpx.Endpoint() as server, tcpx.Endpoint() as client:
        conn = client.connect(server.metadata)          # metadata goes out of band
        peer = server.accept()
        rx = peer.recv_async(dst := np.empty(1 << 20, np.uint8))
        conn.send(np.ones(1 << 20, np.uint8))
        rx.wait(timeout=10)

Behaviour: every blocking call releases the GIL and waits in 20 ms slices, checking for
signals, so Ctrl-C raises ``KeyboardInterrupt`` (the interrupted transfer keeps running;
its memory stays referenced until it finishes, and the connection stays usable). Endpoints
close on ``close()``, on leaving a ``with`` block, on garbage collection and at interpreter
exit. **fork()**: an endpoint belongs to the process that created it (its engine threads
do not exist in a child): in a forked child every call on an inherited endpoint or transfer
raises :class:`Closed` and dropping it frees nothing, while endpoints the child creates
itself work normally (multiprocessing's default *fork* start method is fine).

Configuration comes from the environment exactly as in Rust (``Config::from_env``):
``TCPX_PLUGIN_PATH`` (else the TCPX install paths, else the built-in socket plugin),
``TCPX_NUM_CHANNELS``, ``TCPX_CHUNK_BYTES``, ``TCPX_CONTROL_ADDR``, ``TCPX_TIMEOUT_MS``,
``TCPX_METRICS_ADDR`` (a Prometheus exporter, :attr:`Endpoint.metrics_addr`)...

Rendezvous: instead of handing :attr:`Endpoint.metadata` around, ranks can meet through a
``torch.distributed.Store`` (or any object with its interface):
``conns = ep.rendezvous(store, rank, world)`` gives ``{peer rank: Connection}``.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import _native
from ._buffers import describe
from ._errors import (
    AccessRefused,
    BadArgument,
    Closed,
    Error,
    PeerLost,
    TransferTimeout,
    UnsupportedMemory,
)
from ._native import Transfer

__all__ = [
    "Endpoint",
    "Connection",
    "Region",
    "Transfer",
    "Error",
    "TransferTimeout",
    "PeerLost",
    "AccessRefused",
    "BadArgument",
    "UnsupportedMemory",
    "Closed",
]

_live: "weakref.WeakSet[Endpoint]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for ep in list(_live):
        ep.close()


class Region:
    """Memory registered with an :class:`Endpoint` (``Endpoint.register``).

    Holds the object whose memory it is, so the memory lives as long as the region (and as
    long as any transfer using it). ``region[a:b]`` is a byte range of it, usable wherever a
    region is. Closing (or garbage-collecting) it deregisters it.
    """

    __slots__ = ("_core", "mr_id", "ptr", "nbytes", "cuda", "readonly", "_keep", "__weakref__")

    def __init__(self, core: "_native.Core", obj: Any) -> None:
        self.mr_id: Optional[int] = None
        info = describe(obj, writable=False)
        self._core = core
        self.ptr: int = info.ptr
        self.nbytes: int = info.nbytes
        self.cuda: bool = info.cuda
        self.readonly: bool = info.readonly
        self._keep = info.keep
        self.mr_id: Optional[int] = core.reg(info.ptr, info.nbytes)

    def __getitem__(self, s: slice) -> "RegionView":
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise BadArgument("index a Region with a byte range, region[start:stop]")
        start, stop, _ = s.indices(self.nbytes)
        if stop <= start:
            raise BadArgument(f"empty byte range [{start}:{stop}]")
        return RegionView(self, start, stop - start)

    def close(self) -> None:
        """Deregisters now (transfers in flight finish first on their own)."""
        mr, self.mr_id = getattr(self, "mr_id", None), None
        if mr is not None:
            try:
                self._core.dereg(mr)
            except Error:
                pass  # the endpoint is closed: nothing left to release

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _piece(self) -> Tuple[int, int, int]:
        if self.mr_id is None:
            raise Closed("the region was closed")
        return (self.mr_id, self.ptr, self.nbytes)

    def __repr__(self) -> str:
        kind = "cuda" if self.cuda else "host"
        return f"<tcpx.Region {self.nbytes} bytes of {kind} memory at {self.ptr:#x}>"


class RegionView:
    """``nbytes`` bytes at ``offset`` in a :class:`Region` (``region[a:b]``)."""

    __slots__ = ("region", "offset", "nbytes")

    def __init__(self, region: Region, offset: int, nbytes: int) -> None:
        self.region, self.offset, self.nbytes = region, offset, nbytes

    def _piece(self) -> Tuple[int, int, int]:
        mr, ptr, _ = self.region._piece()
        return (mr, ptr + self.offset, self.nbytes)

    @property
    def readonly(self) -> bool:
        return self.region.readonly


Buffer = Any  # Region, RegionView, numpy array, torch tensor, buffer-protocol object


class Connection:
    """A connection to one peer (``Endpoint.connect`` / ``Endpoint.accept``).

    Two-sided: the k-th ``send`` here pairs with the k-th ``recv`` there (same size); the
    vectored forms pair with each other (the totals must match), and so do the batch forms
    (``send_batch`` / ``recv_batch``: many small messages in one submission). One-sided: ``write`` /
    ``read`` on the peer's advertised memory (``Endpoint.advertise`` there), no call on the
    peer. Buffers are :class:`Region` (fastest: registered once), ``region[a:b]``, or any
    array / tensor / buffer (registered for the call). Closing fails pending transfers.
    """

    def __init__(self, endpoint: "Endpoint", conn_id: int) -> None:
        self._endpoint = endpoint
        self._core = endpoint._core
        self.conn_id = conn_id
        ip, port, gpu = self._core.peer(conn_id)
        self.peer: Tuple[str, int] = (ip, port)
        """The peer's control address."""
        self.peer_gpu: Optional[int] = None if gpu < 0 else gpu
        """The GPU index the peer announced, if any."""

    def _pieces(self, bufs: Iterable[Buffer], writable: bool) -> Tuple[List[Tuple[int, int, int]], List[Any]]:
        pieces, keep = [], []
        for b in bufs:
            if not isinstance(b, (Region, RegionView)):
                b = Region(self._core, b)
            if writable and b.readonly:
                raise BadArgument("cannot receive or read into read-only memory")
            pieces.append(b._piece())
            keep.append(b)
        return pieces, keep

    # Two-sided -----------------------------------------------------------------------
    def send_async(self, buf: Buffer) -> Transfer:
        """Starts sending ``buf``; returns its :class:`Transfer`."""
        pieces, keep = self._pieces((buf,), False)
        return self._core.send(self.conn_id, pieces, keep)

    def recv_async(self, buf: Buffer) -> Transfer:
        """Starts receiving into ``buf`` (the peer sends the same number of bytes)."""
        pieces, keep = self._pieces((buf,), True)
        return self._core.recv(self.conn_id, pieces, keep)

    def send(self, buf: Buffer, timeout: Optional[float] = None) -> int:
        """Sends ``buf`` and waits; returns the bytes sent."""
        return self.send_async(buf).wait(timeout)

    def recv(self, buf: Buffer, timeout: Optional[float] = None) -> int:
        """Receives into ``buf`` and waits; returns the bytes received."""
        return self.recv_async(buf).wait(timeout)

    def sendv_async(self, bufs: Sequence[Buffer]) -> Transfer:
        """Starts sending the concatenation of ``bufs`` as one message (peer: ``recvv``)."""
        pieces, keep = self._pieces(bufs, False)
        return self._core.send(self.conn_id, pieces, keep, vectored=True)

    def recvv_async(self, bufs: Sequence[Buffer]) -> Transfer:
        """Starts receiving one ``sendv`` message into ``bufs``, in order."""
        pieces, keep = self._pieces(bufs, True)
        return self._core.recv(self.conn_id, pieces, keep, vectored=True)

    def sendv(self, bufs: Sequence[Buffer], timeout: Optional[float] = None) -> int:
        """``sendv_async`` and wait."""
        return self.sendv_async(bufs).wait(timeout)

    def recvv(self, bufs: Sequence[Buffer], timeout: Optional[float] = None) -> int:
        """``recvv_async`` and wait."""
        return self.recvv_async(bufs).wait(timeout)

    # Batches of small messages ------------------------------------------------------
    def send_batch_async(self, bufs: Sequence[Buffer]) -> Transfer:
        """Starts sending many small messages in one submission (peer: ``recv_batch``).

        ``bufs`` travel, in order, as one batch: one request and one completion for all of
        them, one packed stream on the wire, instead of one each (the fast path for many
        small messages). The total is 1 byte to 4 MiB (more raises :class:`BadArgument`:
        split it into several batches). Buffers that are not one contiguous run of one
        registration are copied into a pooled pack buffer during this call
        (:meth:`reserve_batches` allocates those up front). Batches are numbered with the
        other sends: the k-th send of any kind pairs with the peer's k-th receive, which must
        be a ``recv_batch`` of the same total.
        """
        pieces, keep = self._pieces(bufs, False)
        return self._core.send_batch(self.conn_id, pieces, keep)

    def recv_batch_async(self, bufs: Sequence[Buffer]) -> Transfer:
        """Starts receiving one ``send_batch`` batch into ``bufs``, in order (same total as the
        peer's batch; with the same sizes on both sides each message lands in its own
        buffer). A scattered list is received into a pack buffer and copied out when the
        transfer is waited on (or ``done()`` polled): read ``bufs`` only after that. A
        total that differs from the peer's fails the transfer instead of hanging."""
        pieces, keep = self._pieces(bufs, True)
        return self._core.recv_batch(self.conn_id, pieces, keep)

    def send_batch(self, bufs: Sequence[Buffer], timeout: Optional[float] = None) -> int:
        """``send_batch_async`` and wait; returns the bytes sent."""
        return self.send_batch_async(bufs).wait(timeout)

    def recv_batch(self, bufs: Sequence[Buffer], timeout: Optional[float] = None) -> int:
        """``recv_batch_async`` and wait; returns the bytes received."""
        return self.recv_batch_async(bufs).wait(timeout)

    def reserve_batches(self, batches: int) -> int:
        """Allocates and registers, now, the pack buffers that ``batches`` batches in flight
        need (capped by ``TCPX_PACK_BUFFERS``), so that the first batches do not pay for
        them; returns the buffers now pooled. Without it the pool grows on demand."""
        if not isinstance(batches, int) or batches < 0:
            raise BadArgument(f"reserve_batches takes a count of batches (>= 0), not {batches!r}")
        return self._core.reserve_batches(self.conn_id, batches)

    def batch_pack_stats(self) -> Dict[str, int]:
        """Packing counters of this connection's batches: ``packed_sent``,
        ``packed_received``, ``fallbacks``, ``overflows``, ``buffers`` (pooled buffers
        allocated so far)."""
        return self._core.batch_pack_stats(self.conn_id)

    # One-sided -----------------------------------------------------------------------
    @staticmethod
    def _lists(local: Union[Buffer, Sequence[Buffer]], remote: Union[bytes, Sequence[bytes]]):
        if isinstance(remote, (bytes, bytearray, memoryview)):
            return [local], [bytes(remote)]
        return list(local), [bytes(r) for r in remote]

    def write_async(self, local, remote, notification: Optional[bytes] = None) -> Transfer:
        """Starts writing ``local`` into the peer's advertised memory ``remote`` (its
        64-byte blob; or lists of both, one batch). ``notification`` reaches the peer's
        ``notifications()`` only after the data landed."""
        bufs, blobs = self._lists(local, remote)
        pieces, keep = self._pieces(bufs, False)
        return self._core.write(self.conn_id, pieces, blobs, keep, notification)

    def read_async(self, local, remote) -> Transfer:
        """Starts reading the peer's advertised memory ``remote`` into ``local``."""
        bufs, blobs = self._lists(local, remote)
        pieces, keep = self._pieces(bufs, True)
        return self._core.read(self.conn_id, pieces, blobs, keep)

    def write(self, local, remote, notification: Optional[bytes] = None, timeout: Optional[float] = None) -> int:
        """``write_async`` and wait."""
        return self.write_async(local, remote, notification).wait(timeout)

    def read(self, local, remote, timeout: Optional[float] = None) -> int:
        """``read_async`` and wait."""
        return self.read_async(local, remote).wait(timeout)

    def notify(self, message: bytes) -> None:
        """Sends a notification (at most 64 KiB), delivered after this side's earlier writes."""
        self._core.notify(self.conn_id, bytes(message))

    def close(self) -> None:
        """Closes the connection (pending transfers fail with :class:`Closed`)."""
        self._core.close_conn(self.conn_id)

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<tcpx.Connection {self.conn_id} to {self.peer[0]}:{self.peer[1]}>"


class Endpoint:
    """This process's presence on the network: a plugin, its engines, a control listener.

    ``Endpoint(gpu=None)``: ``gpu`` is the GPU index announced to peers. Hand
    :attr:`metadata` to peers out of band; they :meth:`connect`, you :meth:`accept`.
    """

    def __init__(self, gpu: Optional[int] = None) -> None:
        self._core = _native.Core(gpu)
        _live.add(self)

    @property
    def metadata(self) -> bytes:
        """Full metadata (address and this endpoint's secret) for ``connect``."""
        return self._core.metadata()

    @property
    def uccl_metadata(self) -> bytes:
        """UCCL's metadata (address, port and GPU bus id; no secret)."""
        return self._core.uccl_metadata()

    @property
    def address(self) -> Tuple[str, int]:
        """(ip, port) of the control listener."""
        return self._core.address()

    @property
    def gpu(self) -> Optional[int]:
        """The GPU index announced to peers."""
        return self._core.gpu_index()

    @property
    def backend(self) -> str:
        """The plugin in use and why it was chosen."""
        return self._core.backend()

    def connect(self, peer: Union[bytes, Tuple[str, int], str]) -> Connection:
        """Connects to ``peer``: its :attr:`metadata` (or UCCL metadata, today's or the older 10/22-byte layout), an
        ``(ip, port)`` tuple or ``"ip:port"``. Releases the GIL; Ctrl-C interrupts."""
        if isinstance(peer, (bytes, bytearray, memoryview)):
            peer = bytes(peer)
            if not peer.startswith(b"TXMD"):  # not tcpx's metadata: UCCL's (either layout)
                from .p2p import Endpoint as _P

                ip, port, _ = _P.parse_metadata(peer)
                conn_id = self._core.connect(ip, port)
            else:
                conn_id = self._core.connect_metadata(peer)
        else:
            if isinstance(peer, str):
                host, _, port_s = peer.rpartition(":")
                if not host or not port_s.isdigit():
                    raise BadArgument(f"expected 'ip:port', got {peer!r}")
                peer = (host.strip("[]"), int(port_s))
            conn_id = self._core.connect(peer[0], int(peer[1]))
        return Connection(self, conn_id)

    def accept(self, timeout: Optional[float] = None) -> Connection:
        """Waits for a peer (at most ``timeout`` seconds: :class:`TransferTimeout`)."""
        conn_id, _, _, _ = self._core.accept(timeout)
        return Connection(self, conn_id)

    def register(self, obj: Any) -> Region:
        """Registers an array / tensor / buffer for repeated use (no copy)."""
        return Region(self._core, obj)

    def advertise(self, buf: Union[Region, RegionView]) -> bytes:
        """Exposes ``buf`` for the peers' one-sided ``write`` / ``read``; returns the
        64-byte blob to hand them. Deregistering (closing) the region revokes it."""
        if not isinstance(buf, (Region, RegionView)):
            raise BadArgument("advertise a Region (Endpoint.register) or a byte range of one")
        return self._core.advertise(*buf._piece())

    def notifications(self) -> List[Tuple[Tuple[str, int], bytes]]:
        """Takes the notifications delivered so far: [((peer ip, port), bytes)], in order."""
        return [((ip, port), msg) for _, ip, port, msg in self._core.notifications()]

    # Rendezvous through a store ------------------------------------------------------
    def rendezvous(
        self,
        store: Any,
        rank: int,
        world: int,
        timeout: Optional[float] = None,
        prefix: str = "tcpx",
        job: str = "group",
    ) -> Dict[int, Connection]:
        """Meets the other ranks of a job through ``store`` and returns ``{rank: Connection}``,
        one connection to every other rank.

        ``store`` is any object with ``torch.distributed.Store``'s interface: ``set(key,
        value)``, ``get(key) -> bytes``, and ``check(keys) -> bool`` or ``wait(keys,
        timedelta)`` (polled in short slices), ``delete_key(key)``; e.g. a
        ``torch.distributed.TCPStore``. Every rank calls this with the same ``world``,
        ``prefix`` and ``job`` and its own ``rank`` (0 <= rank < world). Rank r publishes its
        metadata (secret included) under ``<prefix>/<job>/rank/<r>``, connects to every
        higher rank and accepts from every lower one; its keys are removed when it is done.

        ``timeout`` (seconds) bounds the whole meeting (default: the store's ``timeout``,
        else 300 s): :class:`TransferTimeout` when a rank does not arrive in time, an
        :class:`Error` naming the store and key when the store fails. Releases the GIL;
        Ctrl-C raises ``KeyboardInterrupt`` and stops asking the store.
        """
        pairs = self._core.rendezvous(store, rank, world, timeout, prefix, job)
        return {r: Connection(self, conn_id) for r, conn_id in pairs}

    def publish(self, store: Any, name: str, prefix: str = "tcpx") -> None:
        """Publishes this endpoint's metadata (secret included) in ``store`` (a
        ``torch.distributed.Store``-like object, see :meth:`rendezvous`) under
        ``<prefix>/<name>``, for peers' :meth:`connect_by_name`; then :meth:`accept` them."""
        self._core.publish(store, name, prefix)

    def unpublish(self, store: Any, name: str, prefix: str = "tcpx") -> bool:
        """Removes ``<prefix>/<name>`` from ``store``; whether it was there."""
        return self._core.unpublish(store, name, prefix)

    def connect_by_name(
        self, store: Any, name: str, timeout: Optional[float] = None, prefix: str = "tcpx"
    ) -> Connection:
        """Waits (at most ``timeout`` seconds; default: the store's ``timeout``, else 300 s)
        for ``<prefix>/<name>`` in ``store`` and connects to the endpoint published there,
        presenting its secret. Releases the GIL; Ctrl-C interrupts."""
        return Connection(self, self._core.connect_by_name(store, name, timeout, prefix))

    # Metrics --------------------------------------------------------------------------
    def metrics(self) -> Dict[str, Any]:
        """A snapshot of this endpoint's counters, as a dict:

        * endpoint-wide: ``backend``, ``connections_opened``, ``setup_failures``,
          ``refused_peers``, ``access_refusals``, ``timeouts``, ``peers_lost``, ``failures``;
        * ``connections``: one dict per live connection: ``id`` (the runtime's), ``conn_id``
          (:attr:`Connection.conn_id`, or None when two connections share a peer address),
          ``peer`` (ip, port), ``in_flight``, ``failed``, ``total``, ``channels`` (each
          with ``channel``, ``nic``, ``one_sided`` and its counters) and ``inline``
          (``bytes_sent``, ``bytes_received`` of small one-sided operations carried in
          control messages, on no channel: see ``TCPX_INLINE_BYTES``);
        * ``nics``: counters summed per NIC; ``total``: summed over every live connection.

        Counters: ``bytes_sent``, ``bytes_received``, ``sends``, ``recvs``, ``busy``,
        ``idle_loops``, ``staging_rings``.
        """
        return self._core.metrics()

    def metrics_text(self) -> str:
        """The same snapshot in the Prometheus text format (what the exporter serves)."""
        return self._core.metrics_text()

    @property
    def metrics_addr(self) -> Optional[Tuple[str, int]]:
        """(ip, port) of the Prometheus exporter (``GET /metrics``) when ``TCPX_METRICS_ADDR``
        turned it on (a port of 0 there picks a free one: this says which), else None."""
        return self._core.metrics_addr()

    def close(self) -> None:
        """Closes every connection and stops the engines (idempotent)."""
        self._core.close()

    @property
    def closed(self) -> bool:
        return self._core.closed

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<tcpx.Endpoint (closed)>"
        ip, port = self.address
        return f"<tcpx.Endpoint {ip}:{port} gpu={self.gpu}>"
