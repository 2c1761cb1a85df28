"""CoalescedWrites on a real uvloop TCP server: what is written arrives whole and in order,
whether the socket takes it at once, in part (a small send buffer and a client that reads
late), or while the transport still holds earlier bytes."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import cast

import uvloop

from scriptserve.server.rest.coalesced_writes import CoalescedWrites

PARTS = [bytes([i % 251]) * size for i, size in enumerate((10, 3_000_000, 7, 200_000, 1, 5))]


class Writer(asyncio.Protocol):
    """Writes PARTS through CoalescedWrites as soon as a client connects, some in one loop
    turn, some in later ones, then closes."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's TCPTransport
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16_384)
        loop = asyncio.get_running_loop()
        writes = CoalescedWrites(transport, loop)
        writes.write(PARTS[0])
        writes.write(PARTS[1])  # joined with the first: far more than the socket takes

        def later() -> None:
            writes.write(PARTS[2])  # the transport still buffers: must queue behind it
            writes.write(PARTS[3])
            writes.write(PARTS[4])
            loop.call_later(0.05, last)

        def last() -> None:
            writes.write(PARTS[5])
            writes.close()

        loop.call_soon(later)


def test_writes_arrive_whole_and_in_order() -> None:
    async def main() -> bytes:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Writer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        def read_all() -> bytes:
            with socket.socket() as sock:
                # Small buffers on both sides, set before connecting: the server's writes
                # cannot all go at once.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16_384)
                sock.settimeout(30)
                sock.connect(("127.0.0.1", port))
                time.sleep(0.2)  # let the server's socket fill up first
                data = bytearray()
                while chunk := sock.recv(65536):
                    data += chunk
                return bytes(data)

        try:
            return await loop.run_in_executor(None, read_all)
        finally:
            server.close()

    received = uvloop.run(main())
    assert len(received) == sum(map(len, PARTS))
    assert received == b"".join(PARTS)
