"""UCCL's ``uccl.p2p`` API over tcpx: ``from tcpx import p2p`` runs UCCL p2p scripts.

The names of UCCL's ``p2p/engine_api.cc`` with its argument names, defaults and return
shapes (``p2p.pyi`` lists them; ``tests/uccl_api.txt`` records UCCL's, at the commit named
there):

* ``Endpoint(local_gpu_idx=None, num_cpus=None)``: metadata (``get_metadata``,
  ``Endpoint.parse_metadata``), connections (``connect``, ``add_remote_endpoint``,
  ``remove_remote_endpoint``, ``accept``, ``start_passive_accept``, ``conn_id_of_rank``),
  registration (``reg(ptr, size, floatType=FloatType.kUndefined)``, ``regv``, ``dereg``),
  one-sided calls on 64-byte blobs (``advertise`` / ``advertisev``, ``write`` / ``read`` /
  ``writev`` / ``readv`` and their ``_async`` forms), the descriptor API
  (``register_memory`` -> ``[XferDesc]``, ``deregister_memory``, ``get_serialized_descs``,
  ``deserialize_descs``, ``transfer(conn_id, "read" | "write", local_desc_list,
  remote_desc_list)``), ``poll_async``;
* ``FloatType`` (and its members at module level), ``XferDesc``, ``XferHandle``,
  ``get_oob_ip()``;
* tcpx's additions: ``rendezvous(store, rank, world, timeout=None, prefix="tcpx",
  job="group") -> (ok, {rank: conn_id})`` through any ``torch.distributed.Store``-like
  store (afterwards ``conn_id_of_rank(rank)`` gives them; 2**64-1 for unknown ranks),
  ``metrics()`` (a dict of the endpoint's counters) and ``metrics_text()`` (Prometheus);
* kept from older UCCL: the two-sided calls (``send`` / ``recv`` / ``sendv`` / ``recvv`` and
  ``_async``), ``get_endpoint_metadata``, and the notification calls of UCCL's engine API
  (``send_notif``, ``get_notifs``);
* same-host CUDA IPC (``connect_local``, ``accept_local``, ``advertise_ipc`` /
  ``advertisev_ipc``, ``write_ipc`` / ``read_ipc`` / ``writev_ipc`` / ``readv_ipc`` and their
  ``_async`` forms): UCCL's signatures; the GPUs' own copy engines move the bytes (a list in
  one kernel launch), no socket carries them.

Failures give ``ok = False`` and :func:`last_error` says why; where UCCL still hands back
blobs on failure (``advertisev``, ``advertise_ipc``, ``advertisev_ipc``) they are zeroed, one
per range, as UCCL's. The calls where UCCL raises (``transfer`` with bad arguments,
``deserialize_descs`` of garbage, ``register_memory`` of something that is not memory,
``regv`` with lists of different lengths) raise :class:`tcpx.BadArgument`, which is also a
``RuntimeError`` as UCCL's. Ctrl-C raises ``KeyboardInterrupt``. An endpoint is usable in
the process that created it: after ``fork()`` the child's calls on an inherited endpoint
fail (``Closed``), while endpoints the child creates work.
"""

from ._native import Endpoint, FloatType, XferDesc, XferHandle, get_oob_ip, last_error

# UCCL's enum exports its values into the module (nanobind's export_values).
kUndefined = FloatType.kUndefined
kFloat16 = FloatType.kFloat16
kBFloat16 = FloatType.kBFloat16
kFloat32 = FloatType.kFloat32
kFloat8E4M3FN = FloatType.kFloat8E4M3FN
kFloat8E5M2 = FloatType.kFloat8E5M2

__all__ = [
    "Endpoint",
    "FloatType",
    "XferDesc",
    "XferHandle",
    "get_oob_ip",
    "last_error",
    "kUndefined",
    "kFloat16",
    "kBFloat16",
    "kFloat32",
    "kFloat8E4M3FN",
    "kFloat8E5M2",
]
