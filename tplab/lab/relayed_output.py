"""Output forwarded by ranks on other hosts: notebook side of tplab/rank/output_relay.py.

`ForwardedOutput` listens on the lab's address; each rank's forwarder connects, says who
it is (with the lab's key), and sends what the rank writes to fds 1 and 2, with the byte
offset of each piece in the rank's file. A thread receives it; `read()` hands it to the
Watchdog exactly as `RankFiles.read()` does for local ranks, so the same LiveOutput
groups and labels it. At the end of a cell the rank's reply also carries the cell's
output (`Reply.output`): `catch_up` takes from it what the forwarder had not delivered
yet, by offset, so nothing is shown twice or lost. A forwarder's "ended" frame says that
its rank's process is gone (`ended()`), after its last bytes.
"""

from __future__ import annotations

import codecs
import json
import secrets
import socket
import threading
import time

from tplab.rank.output_relay import ENDED, FRAME

TAIL_BYTES = 65536
STREAMS = ("stdout", "stderr")


class ForwardedOutput:
    """The ranks' forwarded output, received as it arrives (see the module docstring)."""

    def __init__(self):
        self.key = secrets.token_hex(16)
        self.port = 0
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._generation: int | None = None
        self._reset()

    def _reset(self) -> None:
        self._chunks: list[tuple[int, str, str]] = []
        self._have: dict[tuple[int, int], int] = {}  # (rank, stream) -> bytes received
        self._decoders: dict[tuple[int, int], codecs.IncrementalDecoder] = {}
        self._tails: dict[int, list[str]] = {}
        self._ended: set[int] = set()

    # --- the connection ----------------------------------------------------------------

    def listen(self, address: str) -> int:
        """Listen on `address` (the lab's ip) once; returns the port."""
        if self._sock is None:
            self._sock = socket.socket()
            self._sock.bind((address, 0))
            self._sock.listen(256)
            self.port = self._sock.getsockname()[1]
            threading.Thread(target=self._accept, daemon=True,
                             name="tplab-output-accept").start()
        return self.port

    def expect(self, generation: int) -> None:
        """From now on, take output from the ranks of this start only."""
        with self._lock:
            self._generation = generation
            self._reset()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._receive, args=(conn,), daemon=True,
                             name="tplab-output").start()

    def _receive(self, conn: socket.socket) -> None:
        with conn:
            reader = conn.makefile("rb")
            try:
                hello = json.loads(reader.readline(4096) or b"{}")
            except ValueError:
                return
            if not secrets.compare_digest(str(hello.get("key", "")), self.key):
                return  # not one of this lab's ranks
            rank, generation = int(hello["rank"]), hello["generation"]
            while True:
                header = reader.read(FRAME.size)
                if len(header) < FRAME.size:
                    return
                stream, offset, length = FRAME.unpack(header)
                if stream == ENDED:
                    with self._lock:
                        if generation == self._generation:
                            self._ended.add(rank)
                    return
                data = reader.read(length)
                with self._lock:
                    if generation == self._generation:
                        self._take(rank, stream, offset, data)

    def _take(self, rank: int, stream: int, offset: int, data: bytes) -> None:
        """Keep the part of data (at `offset` in the rank's file) not received yet."""
        have = self._have.get((rank, stream), 0)
        end = offset + len(data)
        if end <= have or offset > have:
            return  # seen already (or a gap, which cannot happen on one connection)
        decoder = self._decoders.get((rank, stream))
        if decoder is None:
            decoder = self._decoders[(rank, stream)] = codecs.getincrementaldecoder(
                "utf-8")("replace")
        text = decoder.decode(data[have - offset:])
        self._have[(rank, stream)] = end
        if text:
            self._chunks.append((rank, STREAMS[stream], text))
            tail = self._tails.setdefault(rank, [])
            tail.append(text)
            if sum(map(len, tail)) > 2 * TAIL_BYTES:
                tail[:] = ["".join(tail)[-TAIL_BYTES:]]

    # --- what the Watchdog reads (as of RankFiles) -------------------------------------

    def read(self) -> list[tuple[int, str, str]]:
        with self._lock:
            chunks, self._chunks = self._chunks, []
        return chunks

    def catch_up(self, replies: dict) -> None:
        """Take, from the replies' `output` (offset, bytes per stream), what is missing."""
        with self._lock:
            for rank, reply in replies.items():
                output = getattr(reply, "output", None)
                if output:
                    for stream, (offset, data) in enumerate(output):
                        self._take(rank, stream, offset, data)

    def settle(self, ranks, timeout: float) -> None:
        """Wait until the forwarders of these (ended) ranks said so, at most `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(r in self._ended for r in ranks if r >= 0):
                    return
            time.sleep(0.01)

    def ended(self) -> list[int]:
        with self._lock:
            return sorted(self._ended)

    def tail(self, rank: int, lines: int = 15) -> str:
        with self._lock:
            text = "".join(self._tails.get(rank, [])).splitlines()
        crash = next((i for i, x in enumerate(text) if x.startswith("Fatal Python")), None)
        if crash is not None:
            return "\n".join(text[max(0, crash - 3):crash + lines])
        return "\n".join(text[-lines:])

    def detach_all(self) -> None:
        """The ranks are gone: forget their output (a new start calls expect())."""
        with self._lock:
            self._generation = None
            self._reset()

    def close(self) -> None:
        """Stop listening (the lab is shut down)."""
        self.detach_all()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            except OSError:
                pass
            self._sock.close()
            self._sock = None
