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
        self._held: list[str] = []

    def write(self, text: str) -> int:
        """Line-buffered, like a terminal: a line goes out whole (print's text and its
        newline in one write); a carriage return (a progress bar) or flush() sends at once."""
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self._held.append(text)
        if text.endswith(("\n", "\r")) or len(self._held) > 64:
            self.flush()
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self._held:
            return
        view = memoryview("".join(self._held).encode("utf-8", "replace"))
        self._held.clear()
        while view:
            view = view[os.write(self.fd, view):]

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
