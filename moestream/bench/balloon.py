"""A balloon: a child process that holds and touches memory so that a model
is larger than the RAM left to it (no mlock: plain pages, written once).

The balloon grows until /proc/meminfo's MemAvailable falls to `leave` bytes
and never below `floor` (other processes on a shared machine need room: the
balloon stops growing, and gives back, where MemAvailable drops under it).
It is stopped in `__exit__`, so a `with` block never leaves it behind.
"""

from __future__ import annotations

import subprocess
import sys
import time

from .sysio import meminfo

CHUNK = 256 << 20
FLOOR = 4 << 30  # MemAvailable the balloon never takes the machine under

# The child: grow by CHUNK while MemAvailable > leave, shrink while it is under
# floor, report what it holds on each line; stop on stdin's end.
CHILD = r"""
import mmap, os, sys, threading, time
leave, floor, chunk = (int(x) for x in sys.argv[1:4])
def available():
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
held, done, block = [], threading.Event(), b"\1" * (4 << 20)
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
ready = False
while not done.is_set():
    free = available()
    if free < floor and held:  # the machine needs it back: give it at once
        held.pop().close()
        continue
    if free - chunk > leave:
        m = mmap.mmap(-1, chunk, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for _ in range(chunk // len(block)):
            m.write(block)
        held.append(m)
        continue
    if not ready:
        ready = True
        print(len(held) * chunk, flush=True)
    done.wait(0.2)
"""


class Balloon:
    """`with Balloon(leave=6 << 30) as b:` ... (b.held: bytes it holds)."""

    def __init__(self, leave: int, floor: int = FLOOR, timeout: float = 300) -> None:
        if leave < floor:
            raise ValueError(
                f"leave={leave >> 20} MB is under the floor of {floor >> 20} MB "
                "that a shared machine keeps free."
            )
        self.leave, self.floor, self.timeout = leave, floor, timeout
        self.held = 0
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> Balloon:
        args = [str(self.leave), str(self.floor), str(CHUNK)]
        self._proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            start = time.monotonic()
            line = self._proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise OSError("the balloon process ended before it was ready")
            self.held = int(line)
            self.seconds = time.monotonic() - start
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()  # type: ignore[union-attr]
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def available() -> int:
    return meminfo()["MemAvailable"]
