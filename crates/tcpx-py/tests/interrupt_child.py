"""Blocks in a receive that never completes, for test_interrupt.py: prints READY, then on
SIGINT prints INTERRUPTED and shows the endpoint is still usable."""

import sys
import threading

import numpy as np

layer = sys.argv[1]
if layer == "p2p":
    from tcpx import p2p

    a, b = p2p.Endpoint(), p2p.Endpoint()
    ip, port, _ = p2p.Endpoint.parse_metadata(a.get_metadata())
    got = {}
    t = threading.Thread(target=lambda: got.update(r=a.accept()))
    t.start()
    ok, cid = b.connect(ip, 0, remote_port=port)
    t.join()
    buf = np.zeros(64, np.uint8)
    ok, mr = a.reg(buf.ctypes.data, 64)
    print("READY", flush=True)
    try:
        a.recv(got["r"][3], mr, buf.ctypes.data, 64)
        print("NOT INTERRUPTED", flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    # Still usable: the interrupted receive takes this send.
    src = np.full(64, 1, np.uint8)
    ok, smr = b.reg(src.ctypes.data, 64)
    print("USABLE" if b.send(cid, smr, src.ctypes.data, 64) else "BROKEN", flush=True)
else:
    import tcpx

    a, b = tcpx.Endpoint(), tcpx.Endpoint()
    got = {}
    t = threading.Thread(target=lambda: got.update(c=a.accept(timeout=20)))
    t.start()
    conn = b.connect(a.metadata)
    t.join()
    print("READY", flush=True)
    try:
        got["c"].recv(np.zeros(64, np.uint8))
        print("NOT INTERRUPTED", flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    conn.send(np.zeros(64, np.uint8), timeout=20)
    print("USABLE", flush=True)
