#!/usr/bin/env python3
"""What a request head that arrives one byte at a time costs the /metrics connection loop.

A slowloris client can make every recv() return one byte. The loop looks for the end of the head
after each read; ``web_listener.Conn`` searches only the bytes it has not searched yet, where a
search of the whole buffer each time (what the first version of the loop did) is quadratic in
the head size. Prints the CPU time per connection for a head of ``--bytes`` (default 32000, just
under ``Limits.max_head_bytes``) fed one byte at a time, both ways.

    .venv/bin/python -m bench.bench_web_trickle [--bytes 32000]
"""

from __future__ import annotations

import argparse
import socket
import time

from gpuwatchd.web.connection import HEAD_END, MAX_REQUEST_LINE, Conn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=32000)
    n = ap.parse_args().bytes
    data = b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * n
    with socket.socket() as s:
        conn = Conn(s, "127.0.0.1", None, 0.0)
        t = time.process_time()
        for i in range(len(data)):
            conn.buf += data[i : i + 1]
            conn.take_head()
            conn.request_line_too_long()
        incremental = time.process_time() - t
    buf = bytearray()
    t = time.process_time()
    for i in range(len(data)):
        buf += data[i : i + 1]
        HEAD_END.search(buf)
        buf.find(b"\n", 0, MAX_REQUEST_LINE + 2)
    rescanning = time.process_time() - t
    print(f"head of {len(data)} bytes, one byte per read, CPU seconds per connection:")
    print(f"  web_listener.Conn (searches new bytes only)   {incremental:8.3f}")
    print(f"  whole buffer searched after every read        {rescanning:8.3f}")


if __name__ == "__main__":
    main()
