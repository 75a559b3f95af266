"""A rank's stdout and stderr: the engine's `IPEngine.out_stream_factory`.

ipyparallel's OutStream buffers what a cell prints and publishes it to the client; the lab
instead reads each rank's output files (tplab/lab/streams.py). So print() writes straight
to fd 1 or 2, unbuffered: print(), os.write() and C code then share one path and one order,
and output between cells is not held back.
"""

from __future__ import annotations

import os

from ipykernel.iostream import OutStream


class RankStream(OutStream):
    """Writes to fd 1 (stdout) or 2 (stderr); a subclass of OutStream only because the
    engine's trait asks for one (none of OutStream's machinery is used)."""

    def __init__(self, session=None, pub_thread=None, name: str = "stdout", **kwargs):
        self.name = name
        self.fd = 1 if name == "stdout" else 2
        self.session = session
        self.topic = b""
        self.encoding = "utf-8"

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        view = memoryview(text.encode("utf-8", "replace"))
        while view:
            view = view[os.write(self.fd, view):]
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        pass

    def set_parent(self, parent) -> None:
        pass

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def close(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        return False
