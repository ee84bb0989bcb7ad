"""What an emulated link gives TCP: `python -m compare.launch.linkprobe serve HOST PORT` in one namespace,
`... probe HOST PORT BYTES` in another prints {"latency_s", "bandwidth_Bps", "bytes"} as one JSON line.

Latency is half the median round trip of a 1-byte message (TCP_NODELAY), over 30 trips; bandwidth is
BYTES sent in one stream over the time until the server acknowledges the last byte, less one round trip;
message_Bps the same for one 64 KB message after the link has idled 50 ms (median of 3): what a pipeline's
sends and a small all-reduce see. A token bucket that lets what it holds cross at once shows there, not in the
stream (docs/links.md: 64 KB crossed a 100mbit link at 1.2 Gbit/s before the peak bucket).
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
MESSAGE_BYTES = 64 * 1024  # a pipeline piece's activations at small shapes (tiny: 2 rows x 128 x 64 fp32)
MESSAGES = 3
IDLE_S = 0.05  # long enough to refill a bucket of 64 KB at 20 Mbit/s (26 ms)


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
            while True:  # the stream, then the messages: a size, its bytes, an acknowledgement
                header = conn.recv(8, socket.MSG_WAITALL)
                if len(header) < 8:
                    return
                _recv_exact(conn, int.from_bytes(header, "big"))
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
        elapsed = _send_timed(conn, size)
        messages = []
        for _ in range(MESSAGES):
            time.sleep(IDLE_S)
            messages.append(_send_timed(conn, MESSAGE_BYTES))
    return {"latency_s": rtt / 2, "bandwidth_Bps": size / max(elapsed - rtt, 1e-9), "bytes": size,
            "message_Bps": MESSAGE_BYTES / max(statistics.median(messages) - rtt, 1e-9), "message_bytes": MESSAGE_BYTES}


def _send_timed(conn: socket.socket, size: int) -> float:
    """Seconds from sending `size` bytes until the server acknowledges the last one."""
    payload = bytes(min(size, CHUNK))
    start = time.perf_counter()
    conn.sendall(size.to_bytes(8, "big"))
    left = size
    while left > 0:
        conn.sendall(payload[:min(left, CHUNK)])
        left -= min(left, CHUNK)
    _recv_exact(conn, 1)
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    if argv[0] == "serve":
        serve(argv[1], int(argv[2]))
    else:
        print(json.dumps(probe(argv[1], int(argv[2]), int(argv[3]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
