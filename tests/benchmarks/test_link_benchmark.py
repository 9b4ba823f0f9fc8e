"""The emulated cloud link (benchmarks/link_emulator.py) and the all-reduce benchmark's figures on it: bytes
pass intact through the proxy both ways, a connection ends when its server closes it, the window bounds what
is buffered; the summary's ratios are the ones its phases' walls give. No timing is asserted."""

from __future__ import annotations

import argparse
import os
import socket
import threading

from bench_scripts import load_script

bench = load_script("allreduce")  # puts benchmarks/ on the path, as running a script there does
import link_emulator as emulator  # noqa: E402  (by its own name: the proxy's process imports it so)


def _server_that_echoes_then_closes() -> tuple[socket.socket, threading.Thread]:
    """A TCP server that reads one request (until the client half-closes), sends it back reversed, then
    closes: as an HTTP/1.0 server closes after its response."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while chunk := conn.recv(1 << 16):
                data += chunk
            conn.sendall(data[::-1])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def test_bytes_cross_the_proxy_intact_and_the_connection_ends_with_the_server() -> None:
    listener, thread = _server_that_echoes_then_closes()
    process, endpoint = emulator.start_in_process(listener.getsockname(), emulator.Link(200.0, 0.001))
    try:
        host, port = endpoint.removeprefix("http://").split(":")
        payload = os.urandom(3 << 20)  # several chunks and windows
        with socket.create_connection((host, int(port)), timeout=60) as client:
            client.sendall(payload)
            client.shutdown(socket.SHUT_WR)
            received = b""
            while chunk := client.recv(1 << 16):  # ends: the proxy closes once the server has
                received += chunk
        assert received == payload[::-1]
    finally:
        process.terminate()
        process.join()
        listener.close()
        thread.join(timeout=10)


def test_the_window_is_the_bandwidth_delay_product_with_a_floor_of_chunks() -> None:
    assert emulator.Link(50.0, 0.02).window == 2 * 50_000_000 * 0.02
    assert emulator.Link(1.0, 0.0).window == 4 * (256 << 10)


def test_link_summary_compares_the_exchange_with_the_probe_and_the_sequential_exchange() -> None:
    n, mb = 4, 1.0
    wire = sum(
        len(bench.encode(bench.torch.zeros(b - a), bench.IDENTITY, "fp32"))
        for a, b in bench.shard_bounds(2**18, n)
    )
    bound = 2 * (n - 1) / n * wire
    walls = {"probe": 2.0, "allreduce": 3.0, "sequential": 12.0}
    samples = [
        {
            "phase": phase,
            "repeat": repeat,
            "rank": rank,
            "start": 0.0,
            "end": wall,
            "up": wire,
            "down": int(bound),
        }
        for phase, wall in walls.items()
        for repeat in (0, 1)
        for rank in range(n)
    ]
    args = argparse.Namespace(
        replicas=n, mb=mb, codec="fp32", latency_ms=20.0, link_mbps=50.0, concurrency=8, part_mb=8, repeats=1
    )
    result = bench.summarise_link(samples, args)
    assert result["time_ratio_to_probe_bound"] == 1.5 and result["speedup_vs_sequential"] == 4.0
    assert result["ratio_to_bound"] == int(bound) / bound
    assert result["probe_aggregate_MBps"] == n * (wire + int(bound)) / 1e6 / 2.0
    assert result["link_bound_parallel_s"] * 8 == result["link_bound_sequential_s"]
