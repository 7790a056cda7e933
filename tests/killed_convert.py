"""Run `moestream convert ARGS...`, SIGKILLing itself at the Nth call of one function.

    python killed_convert.py MODULE FUNCTION N ARGS...

A real SIGKILL: no finally blocks, no atexit, no flushing; the test then checks
what the interrupted conversion left on disk.
"""

import importlib
import os
import signal
import sys

module, function, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = importlib.import_module(module)
original = getattr(target, function)
calls = 0


def killer(*args, **kwargs):
    global calls
    calls += 1
    if calls == n:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(*args, **kwargs)


setattr(target, function, killer)

from moestream.cli import main  # noqa: E402

sys.argv = ["moestream", "convert", *sys.argv[4:]]
main()
