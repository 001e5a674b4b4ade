"""The floor the wire benches compare against: bytes over a loopback socket and nothing else."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable


def timed_send(send: Callable[[socket.socket], None], total: int, sink_size: int) -> float:
    """Seconds from the start of ``send`` (which writes ``total`` bytes to a connected loopback
    socket) until a receiver thread has read them all into a ``sink_size``-byte buffer and
    acknowledged; the connection is made before the clock starts."""
    listener = socket.create_server(("127.0.0.1", 0))
    sink = bytearray(sink_size)

    def receive() -> None:
        conn, _ = listener.accept()
        view, left = memoryview(sink), total
        while left:
            left -= conn.recv_into(view[: min(left, len(view))])
        conn.sendall(b"k")
        conn.close()

    receiver = threading.Thread(target=receive)
    receiver.start()
    client = socket.create_connection(listener.getsockname())
    start = time.perf_counter()
    send(client)
    client.recv(1)
    elapsed = time.perf_counter() - start
    receiver.join()
    client.close()
    listener.close()
    return elapsed
