"""Rate-limit what native code (grpc-core) writes to a grader process's stderr.

grpc-core logs from C++ straight to file descriptor 2, a line per event: a client that makes
it log per frame (issue 23: one 8 MB HTTP/2 CONTINUATION flood, 117,749 identical lines, 12 MB)
writes the grader's log for it, and a stderr that cannot drain (a full pipe) then stalls the
server threads that write it. `route_native_stderr` gives Python its own descriptor for
sys.stderr (our tracebacks and log lines are never limited) and points fd 2 at a non-blocking
pipe: a thread forwards at most ``lines_per_s`` native lines a second to the real stderr and,
for each second over budget, one line saying how many it dropped and the last of them. A
native writer never blocks on it; when the pipe is full its line is lost, not the server.

`LineBudget` is the plain decision (unit-tested directly); the rest is descriptor plumbing.
"""

from __future__ import annotations

import os
import select
import sys
import threading
import time


class LineBudget:
    """Admit at most ``per_s`` lines per one-second window; count the rest."""

    def __init__(self, per_s: int) -> None:
        if per_s < 1:
            raise ValueError(f"per_s must be >= 1, got {per_s}")
        self.per_s = per_s
        self.window = None  # start of the current window (seconds)
        self.admitted = 0
        self.dropped = 0
        self.last_dropped = b""

    def offer(self, line: bytes, now: float) -> tuple[bool, bytes | None]:
        """(forward this line?, a summary line to write first for the window just closed)."""
        summary = None
        if self.window is None or now - self.window >= 1.0:
            summary = self.close()
            self.window, self.admitted = now, 0
        if self.admitted < self.per_s:
            self.admitted += 1
            return True, summary
        self.dropped += 1
        self.last_dropped = line
        return False, summary

    def close(self) -> bytes | None:
        """The summary of lines dropped since the last one, if any (and reset the count)."""
        if not self.dropped:
            return None
        text = (f"counterpoint: {self.dropped} more lines of native (grpc-core) log dropped "
                f"(over {self.per_s}/s); the last: ").encode() + self.last_dropped[:300].rstrip(b"\n") + b"\n"
        self.dropped, self.last_dropped = 0, b""
        return text


class NativeStderr:
    """The routing installed by `route_native_stderr` (``thread`` forwards; ``out_fd`` is the
    original stderr)."""

    def __init__(self, read_fd: int, out_fd: int, budget: LineBudget) -> None:
        self.read_fd, self.out_fd, self.budget = read_fd, out_fd, budget
        self.thread = threading.Thread(target=self._forward, name="native-stderr", daemon=True)

    def _write(self, data: bytes) -> None:
        try:
            os.write(self.out_fd, data)
        except OSError:
            pass  # nowhere left to say it

    def _forward(self) -> None:
        pending = b""
        while True:
            try:
                ready, _, _ = select.select([self.read_fd], [], [], 1.0)
                if not ready:  # a quiet second: say what the last busy one dropped
                    summary = self.budget.close()
                    if summary:
                        self._write(summary)
                    continue
                chunk = os.read(self.read_fd, 65536)
            except InterruptedError:
                continue
            except OSError:
                return
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if len(pending) > 65536:  # a "line" without end: forward it in pieces
                lines.append(pending)
                pending = b""
            for line in lines:
                keep, summary = self.budget.offer(line + b"\n", time.monotonic())
                if summary:
                    self._write(summary)
                if keep:
                    self._write(line + b"\n")
        summary = self.budget.close()
        if summary:
            self._write(summary)


def route_native_stderr(lines_per_s: int) -> NativeStderr:
    """Limit native writes to fd 2 to ``lines_per_s`` a second (see the module docstring).
    Call once, early, from the main thread of a server process."""
    out_fd = os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()
    # Python keeps writing to the original stderr, on a descriptor of its own.
    sys.stderr = open(os.dup(out_fd), "w", buffering=1, encoding=getattr(sys.stderr, "encoding", None) or "utf-8",
                      errors="backslashreplace")
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    routed = NativeStderr(read_fd, out_fd, LineBudget(lines_per_s))
    routed.thread.start()
    return routed
