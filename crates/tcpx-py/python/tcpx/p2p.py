"""UCCL's ``uccl.p2p`` API over tcpx: ``from tcpx import p2p`` runs UCCL p2p scripts.

``p2p.Endpoint(local_gpu_idx=None, num_cpus=None)`` with UCCL's methods, argument order,
keyword names, defaults and return tuples: ``get_metadata`` / ``get_endpoint_metadata``
(10 or 22 bytes), ``Endpoint.parse_metadata``, ``connect(ip, remote_gpu_idx,
remote_port=...)`` and ``connect(metadata)`` / ``add_remote_endpoint``, ``accept``,
``reg`` / ``regv`` / ``dereg``, ``send`` / ``recv`` / ``sendv`` / ``recvv`` and their
``_async`` forms, ``poll_async``, ``advertise`` / ``advertisev`` (64-byte blobs),
``write`` / ``read`` / ``writev`` / ``readv`` and their ``_async`` forms, and the
notification calls of UCCL's engine API (``send_notif``, ``get_notifs``). Failures give
``ok = False``; :func:`last_error` says why. Ctrl-C raises ``KeyboardInterrupt``.
"""

from ._native import Endpoint, last_error

__all__ = ["Endpoint", "last_error"]
