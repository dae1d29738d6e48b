#!/usr/bin/env python3
"""The "done when" rows of issue 25 (P11 in docs/PERFORMANCE.md), measured in one call and
printed against their targets: one command in place of the per-session scripts that used to
live outside the repository.

    python3 scripts/perf/issue25_rows.py [--bench target/release/tcpx-bench] [--own-cores]
        [--only host,onesided,gpu,latency,nixl] [--nixl-bundle target/nixl/gpu] [--json OUT]
        [--quick]

Every row runs the real binaries over loopback (the plugin and the control plane pinned to
`lo`), two processes where the row says so, each figure beside its baseline from the same
call:

  host       `tcpx-bench server/client`, 8 channels, host memory, against raw TCP over as many
             streams: 4 KiB >= 0.5, 64 KiB >= 0.8, the 1-256 MiB median >= 0.95 with no size
             under 0.85 (16 and 256 KiB are shown, with no target);
  onesided   `tcpx-bench onesided`, one process: write and read of 4 KiB x 32 (32 in flight)
             and of 64 KiB x 1, each >= 0.9 x a two-sided send of the same bytes;
  gpu        (a CUDA GPU present) a lone 4 KiB one-sided write of GPU memory, p50 <= 2 x the
             same write of host memory; `tcpx-bench kv`, two processes, 1024 x 16 KiB
             scattered GPU blocks WRITE and READ >= 0.8 x one contiguous 16 MiB transfer;
  latency    `tcpx-bench latency`, 4 KiB one way <= 1.3 x raw TCP (P5);
  nixl       (--nixl-bundle: a directory made by integrations/nixl/tests/gpu_bundle.py, or
             `target/nixl` after `cargo xtask nixl` with NIXL importable) the agent
             re-creation loop, 100 pairs with TCPX and UCX in host and GPU memory, no stall
             and TCPX's 2nd transfer of a new pair within 2 x its 10th; NIXL's agents over
             TCPX, host blocks of 1 MiB and more, >= 0.8 x `tcpx-bench server/client` and
             >= 2 x NIXL over UCX (tcp, lo).

--own-cores runs the server of every two-process row on the first half of the CPUs this
script may use and the client on the second half, as on two nodes (the one-process rows get
all of them). Rows whose hardware is missing print SKIP. The exit status is 0 whether or not
the targets are met (these are measurements, not tests); 1 when a run fails.

--quick moves a few MiB per point instead of GiBs: a smoke run that checks the script and the
binaries still agree (flags, JSON fields), not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GROUPS = ("host", "onesided", "gpu", "latency", "nixl")
# Every traffic of these rows stays on loopback (the repository's network rule).
LOOPBACK_ENV = {
    "TCPX_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
    "UCX_NET_DEVICES": "lo",
}
METADATA_TAG = "TCPX-BENCH-METADATA"


class RunFailed(Exception):
    """A command of a row failed: the message says which and how."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Rows:
    """The verdict table: one entry per target, with what was measured."""

    def __init__(self, quick: bool = False) -> None:
        self.rows: list[dict] = []
        # A smoke run's figures judge nothing: its rows say so instead of met / NOT MET.
        self.quick = quick

    def add(self, group: str, name: str, value, target: str, met, detail: str = "") -> None:
        """A measured row: `met` is whether it meets `target` (None: shown, no target)."""
        if met is None:
            verdict = "-"
        elif self.quick:
            verdict = "smoke"
        else:
            verdict = "met" if met else "NOT MET"
        self.rows.append({"group": group, "row": name, "value": value, "target": target,
                          "verdict": verdict, "detail": detail})

    def skip(self, group: str, name: str, why: str) -> None:
        self.rows.append({"group": group, "row": name, "value": None, "target": "",
                          "verdict": "SKIP", "detail": why})

    def print(self) -> None:
        width = max([len(r["row"]) for r in self.rows] + [3])
        print(f"\n{'row':<{width}}  {'measured':>12}  {'target':<12} verdict   detail")
        for r in self.rows:
            v = r["value"]
            shown = "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
            print(f"{r['row']:<{width}}  {shown:>12}  {r['target']:<12} {r['verdict']:<9} "
                  f"{r['detail']}")


class Runner:
    """Runs the bench binary: one process, or a server and a client over loopback."""

    def __init__(self, bench: str, own_cores: bool, timeout: float) -> None:
        self.bench = bench
        self.timeout = timeout
        self.env = dict(os.environ, **LOOPBACK_ENV)
        cpus = sorted(os.sched_getaffinity(0))
        half = len(cpus) // 2
        # With one CPU there is nothing to split; both sides then share it.
        self.server_cpus = set(cpus[:half]) if own_cores and half else None
        self.client_cpus = set(cpus[half:]) if own_cores and half else None

    def _affinity(self, cpus):
        if cpus is None:
            return None
        return lambda: os.sched_setaffinity(0, cpus)

    def one(self, args: list[str], json_path: str) -> list[dict]:
        """Runs `bench ARGS --json PATH` in this process's CPUs; returns its JSON rows."""
        cmd = [self.bench, *args, "--json", fresh(json_path)]
        log("$ " + " ".join(cmd))
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True,
                              timeout=self.timeout)
        if done.returncode != 0:
            raise RunFailed(f"{' '.join(cmd)}: exit {done.returncode}: "
                            f"{tail(done.stderr + done.stdout)}")
        return read_rows(json_path)

    def pair(self, sub: list[str], args: list[str], json_path: str,
             server_only: tuple[str, ...] = (), client_only: tuple[str, ...] = ()) -> list[dict]:
        """Runs `bench SUB server` and `bench SUB client` with ARGS over loopback (plus each
        side's own arguments; the client writes the JSON); returns the client's rows."""
        # Port 0: the kernel picks a free one, and the metadata line carries it.
        server_cmd = [self.bench, *sub, "server", "--bind", "127.0.0.1:0", *args,
                      *server_only]
        log("$ " + " ".join(server_cmd))
        with tempfile.TemporaryFile(mode="w+") as server_log:
            server = subprocess.Popen(server_cmd, env=self.env, stdout=server_log,
                                      stderr=subprocess.STDOUT, text=True,
                                      preexec_fn=self._affinity(self.server_cpus))
            try:
                meta = wait_for_metadata(server, server_log, 30.0)
                client_cmd = [self.bench, *sub, "client", "--peer", meta, *args,
                              *client_only, "--json", fresh(json_path)]
                log("$ " + " ".join("HEX" if a == meta else a for a in client_cmd))
                client = subprocess.run(client_cmd, env=self.env, capture_output=True,
                                        text=True, timeout=self.timeout,
                                        preexec_fn=self._affinity(self.client_cpus))
                if client.returncode != 0:
                    raise RunFailed(f"{' '.join(sub)} client: exit {client.returncode}: "
                                    f"{tail(client.stderr + client.stdout)}")
                server.wait(timeout=30)
            finally:
                if server.poll() is None:
                    server.send_signal(signal.SIGTERM)
                    try:
                        server.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        server.kill()
                        server.wait()
        return read_rows(json_path)


def wait_for_metadata(server: subprocess.Popen, server_log, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        server_log.seek(0)
        for line in server_log.read().splitlines():
            if METADATA_TAG in line:
                return line.split(METADATA_TAG, 1)[1].split()[0]
        if server.poll() is not None:
            server_log.seek(0)
            raise RunFailed(f"the server exited ({server.returncode}): {tail(server_log.read())}")
        time.sleep(0.05)
    raise RunFailed(f"the server printed no {METADATA_TAG} line within {seconds:.0f} s")


def fresh(path: str) -> str:
    """`path`, with what an earlier run (--keep) left there removed."""
    if os.path.exists(path):
        os.remove(path)
    return path


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tail(text: str, lines: int = 8) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def kib(n: int) -> int:
    return n << 10


def mib(n: int) -> int:
    return n << 20


def host_rows(run: Runner, rows: Rows, tmp: str, quick: bool) -> None:
    small = ["--channels", "8", "--sizes", "4KiB,16KiB,64KiB,256KiB", "--rounds",
             "1" if quick else "3", "--min-bytes", "8MiB" if quick else "1GiB"]
    large_sizes = "1MiB,4MiB" if quick else "1MiB,4MiB,16MiB,64MiB,256MiB"
    large = ["--channels", "8", "--sizes", large_sizes, "--rounds", "1" if quick else "3",
             "--min-bytes", "16MiB" if quick else "2GiB"]
    by_size = {}
    for args, name in ((small, "small"), (large, "large")):
        for r in run.pair([], args, os.path.join(tmp, f"host-{name}.json")):
            by_size[r["bytes"]] = r
    for size, label, floor in ((kib(4), "4 KiB", 0.5), (kib(16), "16 KiB", None),
                               (kib(64), "64 KiB", 0.8), (kib(256), "256 KiB", None)):
        r = by_size[size]
        rows.add("host", f"server/client {label} x raw TCP", r["ratio"],
                 "-" if floor is None else f">= {floor}",
                 None if floor is None else r["ratio"] >= floor,
                 f"{r['gbps']:.2f} / {r['baseline_gbps']:.2f} GB/s")
    big = sorted((s, r["ratio"]) for s, r in by_size.items() if s >= mib(1))
    median = statistics.median(x for _, x in big)
    lowest = min(big, key=lambda p: p[1])
    rows.add("host", "server/client 1-256 MiB median", median, ">= 0.95", median >= 0.95,
             " ".join(f"{s >> 20}M:{x:.2f}" for s, x in big))
    rows.add("host", "server/client 1-256 MiB lowest", lowest[1], ">= 0.85",
             lowest[1] >= 0.85, f"at {lowest[0] >> 20} MiB")


def onesided_rows(run: Runner, rows: Rows, tmp: str, quick: bool) -> None:
    # 32 operations in flight over 8 channels, long points: shorter ones mostly measured
    # start-up (docs/RESULTS.md, thirty-second session).
    args = ["onesided", "--op", "send,write,read", "--block", "4KiB,64KiB", "--batch", "32,1",
            "--channels", "8", "--depth", "32", "--bytes", "32MiB" if quick else "4GiB",
            "--reps", "1" if quick else "5", "--latency-iters", "10" if quick else "100"]
    got = run.one(args, os.path.join(tmp, "onesided.json"))
    for block, batch in ((kib(4), 32), (kib(64), 1)):
        for op in ("write", "read"):
            r = next(x for x in got if x["op"] == op and x["block"] == block
                     and x["batch"] == batch)
            rows.add("onesided", f"one-sided {block >> 10} KiB x {batch} {op} x send",
                     r["ratio"], ">= 0.9", r["ratio"] >= 0.9,
                     f"{r['gbps']:.2f} / {r['send_gbps']:.2f} GB/s")


def gpu_rows(run: Runner, rows: Rows, tmp: str, quick: bool, gpus: int) -> None:
    if gpus == 0:
        rows.skip("gpu", "GPU 4 KiB write p50 x host", "no CUDA GPU (nvidia-smi -L)")
        rows.skip("gpu", "GPU kv 1024 x 16 KiB x contiguous", "no CUDA GPU")
        return
    pair = "0,1" if gpus > 1 else "0"
    lat = ["onesided", "--op", "write", "--block", "4KiB", "--batch", "1",
           "--latency-iters", "50" if quick else "300", "--bytes", "4MiB" if quick else "64MiB"]
    host = run.one([*lat, "--memory", "host"], os.path.join(tmp, "gpu-host.json"))[-1]
    cuda = run.one([*lat, "--memory", "cuda", "--gpu", pair],
                   os.path.join(tmp, "gpu-cuda.json"))[-1]
    ratio = cuda["p50_us"] / host["p50_us"]
    rows.add("gpu", "GPU 4 KiB write p50 x host", ratio, "<= 2.0", ratio <= 2.0,
             f"{cuda['p50_us']:.1f} / {host['p50_us']:.1f} us, GPUs {pair}")
    kv = ["--shapes", "1024x16KiB", "--memory", "cuda", "--channels", "8",
          "--min-bytes", "32MiB" if quick else "256MiB"]
    # Each process on its own GPU when there are two (as on two nodes).
    server_gpu, client_gpu = ("0", "1") if gpus > 1 else ("0", "0")
    got = run.pair(["kv"], kv, os.path.join(tmp, "kv.json"),
                   server_only=("--gpu", server_gpu), client_only=("--gpu", client_gpu))
    for op in ("write", "read"):
        r = next(x for x in got if x["op"] == op and x["layout"] == "scattered"
                 and not x["first"])
        rows.add("gpu", f"GPU kv 1024 x 16 KiB {op} x contiguous", r["vs_contiguous"],
                 ">= 0.8", r["vs_contiguous"] >= 0.8,
                 f"{r['gbps']:.2f} / {r['contiguous_gbps']:.2f} GB/s")


def latency_rows(run: Runner, rows: Rows, tmp: str, quick: bool) -> None:
    got = run.one(["latency", "--sizes", "4KiB", "--iters", "2000" if quick else "20000"],
                  os.path.join(tmp, "latency.json"))
    r = next(x for x in got if x["bytes"] == kib(4))
    rows.add("latency", "latency 4 KiB x raw TCP", r["ratio"], "<= 1.3", r["ratio"] <= 1.3,
             f"{r['p50_us']:.1f} / {r['tcp_p50_us']:.1f} us")


def nixl_rows(run: Runner, rows: Rows, tmp: str, quick: bool, bundle: str | None,
              module: str, gpus: int) -> None:
    if not bundle:
        rows.skip("nixl", "NIXL re-creation loops", "no --nixl-bundle")
        rows.skip("nixl", "NIXL TCPX host >= 1 MiB", "no --nixl-bundle")
        return
    env = dict(run.env)
    site = os.path.join(bundle, "site.tar.gz")
    unpacked = None
    if os.path.exists(site):
        # NIXL's Python agent and its libraries, packed by gpu_bundle.py for a machine
        # without network access; unpacked outside --keep (it is large).
        unpacked = tempfile.mkdtemp(prefix="nixl-site-")
        # Our own bundle: its links are NIXL's library names, kept as they are.
        trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
        with tarfile.open(site) as t:
            t.extractall(unpacked, **trusted)
        env["PYTHONPATH"] = unpacked + os.pathsep + env.get("PYTHONPATH", "")
    env["NIXL_PLUGIN_DIR"] = os.path.abspath(os.path.join(bundle, "plugins"))
    env["TCPX_NIXL_MODULE"] = module
    try:
        nixl_runs(run, rows, tmp, quick, env, module, gpus)
    finally:
        if unpacked:
            shutil.rmtree(unpacked, ignore_errors=True)


def nixl_runs(run: Runner, rows: Rows, tmp: str, quick: bool, env: dict, module: str,
              gpus: int) -> None:
    python = sys.executable
    pairs = 10 if quick else 100
    memories = ("DRAM", "VRAM") if gpus else ("DRAM",)
    tcpx_vram = None
    for memory in memories:
        for backend in ("TCPX", "UCX"):
            out = fresh(os.path.join(tmp, f"rc-{backend}-{memory}.json"))
            cmd = [python, os.path.join(ROOT, "integrations/nixl/tests/recreate.py"),
                   "--backend", backend, "--memory", memory, "--iterations", str(pairs),
                   "--json", out]
            log("$ " + " ".join(cmd))
            done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=run.timeout)
            if not os.path.exists(out):
                raise RunFailed(f"recreate.py {backend} {memory}: exit {done.returncode}: "
                                f"{tail(done.stderr + done.stdout)}")
            with open(out) as f:
                got = json.load(f)
            clean = got["pairs_done"] == got["pairs_requested"] and not got["stall"]
            firsts = got["first_transfers_ms"]
            second_tenth = firsts[1] / firsts[9] if len(firsts) >= 10 and firsts[9] else None
            detail = (f"{got['pairs_done']}/{got['pairs_requested']} pairs"
                      + (f", stall: {got['stall']}" if got["stall"] else "")
                      + (f", 2nd/10th {second_tenth:.2f}" if second_tenth else ""))
            rows.add("nixl", f"NIXL re-creation {backend} {memory}", got["pairs_done"],
                     f"{pairs} clean", clean, detail)
            if backend == "TCPX" and memory == "VRAM":
                tcpx_vram = second_tenth
    if tcpx_vram is not None:
        rows.add("nixl", "NIXL TCPX VRAM 2nd / 10th transfer", tcpx_vram, "<= 2.0",
                 tcpx_vram <= 2.0, "medians over the pairs")
    else:
        rows.skip("nixl", "NIXL TCPX VRAM 2nd / 10th transfer", "no GPU")
    out = fresh(os.path.join(tmp, "compare.json"))
    cmd = [python, os.path.join(ROOT, "integrations/nixl/bench/compare.py"), "--memory", "host",
           "--channels", "8", "--iters", "4" if quick else "20", "--nixl-module", module,
           "--tcpx-bench", run.bench, "--json", out]
    log("$ " + " ".join(cmd))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=run.timeout)
    if done.returncode != 0 or not os.path.exists(out):
        raise RunFailed(f"compare.py: exit {done.returncode}: {tail(done.stderr + done.stdout)}")
    with open(out) as f:
        got = json.load(f)
    bench = {r["bytes"]: r["gbps"] for r in got["tcpx_bench"]}
    nixl = got["nixl"]
    vs_bench, vs_ucx = [], []
    for r in nixl:
        if r["backend"] != "TCPX" or r["block_bytes"] < mib(1):
            continue
        ucx = next((u for u in nixl if u["backend"] == "UCX" and u["workload"] == r["workload"]
                    and u["op"] == r["op"]), None)
        if ucx and ucx["gbps"]:
            vs_ucx.append((r["gbps"] / ucx["gbps"], f"{r['workload']} {r['op']}"))
        total = r["blocks"] * r["block_bytes"]
        if r["kind"] == "large" and bench.get(total):
            vs_bench.append((r["gbps"] / bench[total], f"{r['workload']} {r['op']}"))
    if vs_bench:
        low = min(vs_bench)
        rows.add("nixl", "NIXL TCPX host >= 1 MiB x tcpx-bench (lowest)", low[0], ">= 0.8",
                 low[0] >= 0.8, f"at {low[1]}; " + " ".join(f"{x:.2f}" for x, _ in vs_bench))
    if vs_ucx:
        low = min(vs_ucx)
        rows.add("nixl", "NIXL TCPX host >= 1 MiB x UCX (lowest)", low[0], ">= 2.0",
                 low[0] >= 2.0, f"at {low[1]}; UCX_TLS=tcp,self on lo")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--bench", default=os.path.join(ROOT, "target/release/tcpx-bench"))
    ap.add_argument("--own-cores", action="store_true",
                    help="server on the first half of the CPUs, client on the second")
    ap.add_argument("--only", default=",".join(GROUPS),
                    help=f"comma list of row groups ({', '.join(GROUPS)})")
    ap.add_argument("--nixl-bundle", help="directory with plugins/ (and site.tar.gz)")
    ap.add_argument("--nixl-module", default=os.environ.get("TCPX_NIXL_MODULE", "nixl_cu13"))
    ap.add_argument("--quick", action="store_true", help="a smoke run: a few MiB per point")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per command")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--keep", help="keep every command's own JSON output in this directory")
    args = ap.parse_args()
    only = [g for g in args.only.split(",") if g]
    unknown = [g for g in only if g not in GROUPS]
    if unknown:
        ap.error(f"unknown group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    if not os.access(args.bench, os.X_OK):
        ap.error(f"{args.bench} is not an executable: cargo build --release -p tcpx-tools")
    run = Runner(os.path.abspath(args.bench), args.own_cores, args.timeout)
    gpus = gpu_count()
    rows = Rows(args.quick)
    started = time.monotonic()
    failed = False
    with tempfile.TemporaryDirectory(prefix="issue25-") as scratch:
        tmp = scratch
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            tmp = args.keep
        for group in only:
            try:
                if group == "host":
                    host_rows(run, rows, tmp, args.quick)
                elif group == "onesided":
                    onesided_rows(run, rows, tmp, args.quick)
                elif group == "gpu":
                    gpu_rows(run, rows, tmp, args.quick, gpus)
                elif group == "latency":
                    latency_rows(run, rows, tmp, args.quick)
                elif group == "nixl":
                    nixl_rows(run, rows, tmp, args.quick, args.nixl_bundle, args.nixl_module,
                              gpus)
            except (RunFailed, subprocess.TimeoutExpired, KeyError, StopIteration,
                    ValueError) as e:
                failed = True
                rows.rows.append({"group": group, "row": f"{group} rows", "value": None,
                                  "target": "-", "verdict": "FAILED",
                                  "detail": f"run failed: {e!r}"[:400]})
    cpus = len(os.sched_getaffinity(0))
    print(f"# issue 25 rows: {cpus} CPUs{', own cores per side' if args.own_cores else ''}, "
          f"{gpus} GPU(s){', quick (not a measurement)' if args.quick else ''}; "
          f"{time.monotonic() - started:.0f} s")
    rows.print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": cpus, "gpus": gpus, "own_cores": args.own_cores,
                       "quick": args.quick, "rows": rows.rows}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
