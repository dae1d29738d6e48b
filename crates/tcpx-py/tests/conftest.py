"""Every test talks over loopback only (README, "Network rule"): the socket plugin is pinned
to `lo` and control listeners to 127.0.0.1, here and in every child process."""

import os
import sys

os.environ["TCPX_SOCKET_IFNAME"] = "lo"
os.environ["NCCL_SOCKET_IFNAME"] = "lo"
os.environ["TCPX_CONTROL_ADDR"] = "127.0.0.1:0"
os.environ.setdefault("TCPX_TIMEOUT_MS", "20000")
os.environ.setdefault("TCPX_NUM_CHANNELS", "2")
# Children started with the spawn method import helpers from this directory.
sys.path.insert(0, os.path.dirname(__file__))
