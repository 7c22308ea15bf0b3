"""One-way latency of the API process's output path, idle to idle (issue 41, time to first token).

A sender process, idle between messages (``--gap-ms``, as an engine core between the steps of
one request), stamps ``time.monotonic()`` (CLOCK_MONOTONIC, shared by processes) into each
message; an asyncio event loop in this process takes the stamp off and records how long the
message took to reach a callback on the loop. Three transports:

- ``zmq-thread``: what ``runtime/core/client.py`` does: a ZMQ PUSH -> PULL pair over ``ipc://``,
  a receiver thread polling the PULL socket, ``call_soon_threadsafe`` onto the loop;
- ``zmq-loop``: the same sockets, the PULL socket's file descriptor watched by the loop itself
  (``add_reader``; no receiver thread);
- ``unix``: a plain Unix stream socket watched by the loop (the floor: no ZMQ I/O threads).

The difference between the first two is the receiver thread's hop; between the last two,
ZMQ's I/O threads (one per process, each a wake-up). The request path (API -> core) crosses
the same two I/O threads, so a first token pays them twice.

    python bench/ipc_latency.py --messages 300 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

SENDER = """
import socket, struct, sys, time
kind, address, count, gap = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
if kind == "unix":
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(address); send = s.sendall
else:
    import zmq
    s = zmq.Context().socket(zmq.PUSH); s.connect(address); send = s.send
time.sleep(0.5)
for _ in range(count):
    time.sleep(gap)
    send(struct.pack("d", time.monotonic()))
time.sleep(0.5)
"""
STAMP = struct.Struct("d")


def measure(transport: str, count: int, gap_ms: float) -> list[float]:
    """Latencies (ms) of ``count`` messages over ``transport``, sender idle ``gap_ms`` between them."""
    folder = Path(tempfile.mkdtemp(prefix="onecat-ipc-"))
    context = zmq.Context()
    if transport == "unix":
        address = str(folder / "sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(1)
    else:
        address = f"ipc://{folder}/sock"
        pull = context.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(address)
    sender = subprocess.Popen([sys.executable, "-c", SENDER, "unix" if transport == "unix" else "zmq",
                               address, str(count), str(gap_ms / 1000)])
    latencies: list[float] = []
    threads: list[threading.Thread] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def arrived(data: bytes) -> None:
            latencies.append(1000 * (time.monotonic() - STAMP.unpack(data)[0]))
            if len(latencies) == count:
                done.set()

        if transport == "zmq-thread":
            def receive() -> None:
                while len(latencies) < count and not done.is_set():
                    if pull.poll(200):
                        loop.call_soon_threadsafe(arrived, pull.recv())

            threads.append(threading.Thread(target=receive, daemon=True))
            threads[0].start()
        elif transport == "zmq-loop":
            def drain() -> None:
                while pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    arrived(pull.recv(zmq.NOBLOCK))

            loop.add_reader(pull.getsockopt(zmq.FD), drain)
            drain()
        else:
            connection, _ = await loop.sock_accept(listener)
            buffer = bytearray()

            def read() -> None:
                buffer.extend(connection.recv(65536))
                while len(buffer) >= STAMP.size:
                    arrived(bytes(buffer[:STAMP.size]))
                    del buffer[:STAMP.size]

            loop.add_reader(connection.fileno(), read)
        await asyncio.wait_for(done.wait(), 60 + count * gap_ms / 1000)

    try:
        asyncio.run(run())
    finally:
        for thread in threads:
            thread.join()
        sender.kill()
        sender.wait()
        context.destroy(linger=0)
    return latencies


def main() -> None:
    """Measure each transport ``--repeats`` times, interleaved, and print medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transports", default="zmq-thread,zmq-loop,unix")
    args = parser.parse_args()
    transports = args.transports.split(",")
    rows: dict[str, list[float]] = {t: [] for t in transports}
    for _ in range(args.repeats):
        for transport in transports:
            values = measure(transport, args.messages, args.gap_ms)[args.messages // 10:]  # after warm-up
            rows[transport].append(statistics.median(values))
    print(f"{'transport':12s} {'median of runs (ms)':>20s}   runs")
    for transport, medians in rows.items():
        runs = " ".join(f"{m:.3f}" for m in medians)
        print(f"{transport:12s} {statistics.median(medians):20.3f}   {runs}")


if __name__ == "__main__":
    main()
