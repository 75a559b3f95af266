"""Forwarding a rank's output to the notebook, for ranks on other hosts: rank side (runs
as `python -m tplab.rank.output_relay`, a child of the rank; imports nothing from the notebook
side, nor torch: it starts in a few tens of milliseconds).

A rank's fds 1 and 2 point at two files of its own (tplab/rank/entry.py); on the notebook's
machine the notebook reads them as they grow (tplab/lab/streams.py). A rank elsewhere
starts this forwarder instead: it reads the same two files as they grow and sends what is
new to the notebook over one TCP connection (tplab/lab/relayed_output.py), every POLL_S. It is
a process of its own so that a rank that hangs, crashes or is interrupted loses nothing:
when the rank is gone (its parent changed) it sends the files' last bytes, then an
"ended" frame, and exits. The connection opens with the lab's key (a random secret sent
to the rank in init_rank), so the notebook drops connections that do not come from its
ranks. Wire format: a hello line (JSON), then frames `>BQI` (stream: 0 stdout, 1 stderr,
255 ended; the byte offset in the file; the length) followed by the bytes.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time

FRAME = struct.Struct(">BQI")
ENDED = 255
KEY_ENV = "TPLAB_OUTPUT_KEY"
POLL_S = 0.005
CHUNK = 1 << 20


def start(rank: int, generation: int, host: str, port: int, key: str, out_path: str,
          err_path: str) -> subprocess.Popen:
    """Start the forwarder of this rank (called on the rank, by rank.init_rank)."""
    spec = {"rank": rank, "generation": generation, "host": host, "port": port,
            "files": [out_path, err_path], "parent": os.getpid()}
    log = os.path.join(os.path.dirname(out_path), f"{os.getpid()}.forward.log")
    with open(log, "ab") as f:  # never fds 1 and 2: they are what is forwarded
        return subprocess.Popen([sys.executable, "-m", "tplab.rank.output_relay", json.dumps(spec)],
                                stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                                env={**os.environ, KEY_ENV: key}, close_fds=True)


def _connect(host: str, port: int, parent: int, timeout: float = 30.0) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError:
            if time.monotonic() > deadline or os.getppid() != parent:
                raise
            time.sleep(0.05)


def _send_new(sock: socket.socket, fds: list[int], offsets: list[int]) -> bool:
    sent = False
    for stream, fd in enumerate(fds):
        size = os.fstat(fd).st_size
        while size > offsets[stream]:
            data = os.pread(fd, min(CHUNK, size - offsets[stream]), offsets[stream])
            if not data:
                break
            sock.sendall(FRAME.pack(stream, offsets[stream], len(data)) + data)
            offsets[stream] += len(data)
            sent = True
    return sent


def main(spec: dict) -> None:
    fds = [os.open(path, os.O_RDONLY) for path in spec["files"]]
    sock = _connect(spec["host"], spec["port"], spec["parent"])
    hello = {"key": os.environ.get(KEY_ENV, ""), "rank": spec["rank"],
             "generation": spec["generation"]}
    sock.sendall(json.dumps(hello).encode() + b"\n")
    offsets = [0, 0]
    while True:
        alive = os.getppid() == spec["parent"]
        sent = _send_new(sock, fds, offsets)
        if not alive:  # the rank is gone: what it wrote last was just sent
            sock.sendall(FRAME.pack(ENDED, 0, 0))
            sock.close()
            return
        if not sent:
            time.sleep(POLL_S)


if __name__ == "__main__":
    try:
        main(json.loads(sys.argv[1]))
    except OSError:  # the notebook is gone (or never reachable): nothing to forward to
        sys.exit(1)
