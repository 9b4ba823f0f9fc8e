"""A loopback TCP proxy that makes a local S3 server (moto) behave like a cloud object store's links.

    python benchmarks/link_emulator.py --upstream 127.0.0.1:5000 --latency-ms 20 --mbps 50

Every connection through the proxy gets, in each direction, a bandwidth cap (``--mbps``, MB/s = 10^6 bytes
per second) and a one-way delay (``--latency-ms``), as ``tc qdisc ... netem delay 20ms rate 400mbit`` would
on a link of its own: a request/response round trip gains twice the delay, and a stream of N bytes takes
N / rate after its first byte. Connections do not share a cap, so the aggregate grows with connections, as a
cloud store's does (S3: about 50-150 MB/s per connection, scaling with parallel requests) until this
machine's CPU (the proxy, moto and the clients share it) is the limit: the benchmark measures that limit in
the same run with a probe, and reports against it.

Back-pressure is kept: each direction buffers at most ``window`` bytes (the bandwidth-delay product plus a
margin) before it stops reading, so a sender sees the capped rate instead of loopback speed into a buffer.
The proxy runs in a process of its own (``start_in_process``), with its own GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import socket
import sys
import time
from dataclasses import dataclass

_CHUNK = 256 << 10


@dataclass(frozen=True)
class Link:
    """One direction of one connection: a rate cap and a one-way delay."""

    mbps: float
    latency_s: float

    @property
    def window(self) -> int:
        """Bytes in flight in one direction before the proxy stops reading: the bandwidth-delay product, at
        least a few chunks so the cap, not the window, bounds the rate."""
        return max(4 * _CHUNK, int(2 * self.mbps * 1e6 * self.latency_s))


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
    """Forward ``reader`` to ``writer``: each chunk leaves once the cap allows and arrives ``latency`` later."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    room = asyncio.Semaphore(max(1, link.window // _CHUNK))
    rate = link.mbps * 1e6

    async def receive() -> None:
        free_at = 0.0  # when the capped link has sent everything queued so far
        try:
            while True:
                await room.acquire()
                data = await reader.read(_CHUNK)
                if not data:
                    break
                now = time.monotonic()
                free_at = max(now, free_at) + len(data) / rate
                await queue.put((free_at + link.latency_s, data))
        finally:
            await queue.put((0.0, b""))

    async def deliver() -> None:
        try:
            while True:
                at, data = await queue.get()
                if not data:
                    break
                delay = at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
                room.release()
        finally:
            with contextlib.suppress(OSError):
                if writer.can_write_eof():
                    writer.write_eof()

    # When one side fails (the peer went away) the other is stopped too, not left waiting for ever.
    halves = [asyncio.ensure_future(receive()), asyncio.ensure_future(deliver())]
    try:
        await asyncio.gather(*halves)
    finally:
        for half in halves:
            half.cancel()
        await asyncio.gather(*halves, return_exceptions=True)


async def _serve(listener: socket.socket, upstream: tuple[str, int], link: Link) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*upstream, limit=_CHUNK)
        except OSError:
            client_w.close()
            return
        # The connection lasts as long as the server's side of it: when the server closes (an HTTP/1.0
        # server does after each response) the client's direction is stopped too, so a client never sends
        # into a connection its server has left. A client that half-closes still gets its answer.
        to_server = asyncio.ensure_future(_pump(client_r, server_w, link))
        to_client = asyncio.ensure_future(_pump(server_r, client_w, link))
        try:
            await to_client
        except (ConnectionError, OSError):
            pass  # the client went away
        finally:
            to_server.cancel()
            await asyncio.gather(to_server, to_client, return_exceptions=True)
            for w in (client_w, server_w):
                with contextlib.suppress(OSError):
                    w.close()

    # asyncio holds a connection's task only through its transport; held here too, a task whose client
    # closed first is not collected while it is still closing its server side.
    running: set[asyncio.Task[None]] = set()

    def connected(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(handle(client_r, client_w))
        running.add(task)
        task.add_done_callback(running.discard)

    server = await asyncio.start_server(connected, sock=listener, limit=_CHUNK)
    async with server:
        await server.serve_forever()


def _run(listener: socket.socket, upstream: tuple[str, int], link: Link) -> None:
    asyncio.run(_serve(listener, upstream, link))


def start_in_process(upstream: tuple[str, int], link: Link) -> tuple[mp.process.BaseProcess, str]:
    """Start the proxy in a child process; returns it and the ``http://host:port`` endpoint to use. The
    listening socket is bound here, so the endpoint accepts connections as soon as this returns."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    host, port = listener.getsockname()
    process = mp.get_context("spawn").Process(target=_run, args=(listener, upstream, link), daemon=True)
    process.start()
    listener.close()
    return process, f"http://{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="host:port of the S3 server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency-ms", type=float, default=20.0, help="one-way delay per direction")
    parser.add_argument("--mbps", type=float, default=50.0, help="cap per connection and direction, MB/s")
    args = parser.parse_args(argv)
    host, port = args.upstream.rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", args.port))
    print(f"http://127.0.0.1:{listener.getsockname()[1]}", flush=True)
    _run(listener, (host, int(port)), Link(args.mbps, args.latency_ms / 1e3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
