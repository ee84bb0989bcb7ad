"""What an emulated link gives TCP: `python -m compare.launch.linkprobe serve HOST PORT` in one namespace,
`... probe HOST PORT BYTES` in another prints {"latency_s", "bandwidth_Bps", "bytes"} as one JSON line.

Latency is half the median round trip of a 1-byte message (TCP_NODELAY), over 30 trips; bandwidth is
BYTES sent in one stream over the time until the server acknowledges the last byte, less one round trip.
No framework is imported: the probe takes a fraction of a second beside a job's start-up.
"""
from __future__ import annotations

import json
import socket
import statistics
import sys
import time

TRIPS = 30
CHUNK = 1 << 20


def _recv_exact(conn: socket.socket, n: int) -> None:
    while n > 0:
        got = conn.recv(min(n, CHUNK))
        if not got:
            raise ConnectionError("peer closed")
        n -= len(got)


def serve(host: str, port: int) -> None:
    with socket.create_server((host, port)) as server:
        server.settimeout(30)
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(TRIPS):
                _recv_exact(conn, 1)
                conn.sendall(b"p")
            size = int.from_bytes(conn.recv(8), "big")
            _recv_exact(conn, size)
            conn.sendall(b"k")


def probe(host: str, port: int, size: int) -> dict:
    deadline = time.monotonic() + 10
    while True:  # the server starts beside us: retry until it listens
        try:
            conn = socket.create_connection((host, port), timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        trips = []
        for _ in range(TRIPS):
            start = time.perf_counter()
            conn.sendall(b"p")
            _recv_exact(conn, 1)
            trips.append(time.perf_counter() - start)
        rtt = statistics.median(trips)
        payload = bytes(CHUNK)
        start = time.perf_counter()
        conn.sendall(size.to_bytes(8, "big"))
        left = size
        while left > 0:
            conn.sendall(payload[:min(left, CHUNK)])
            left -= min(left, CHUNK)
        _recv_exact(conn, 1)
        elapsed = time.perf_counter() - start
    return {"latency_s": rtt / 2, "bandwidth_Bps": size / max(elapsed - rtt, 1e-9), "bytes": size}


def main(argv: list[str]) -> int:
    if argv[0] == "serve":
        serve(argv[1], int(argv[2]))
    else:
        print(json.dumps(probe(argv[1], int(argv[2]), int(argv[3]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
