"""`moestream convert ARGS...` in a process that can be SIGKILLed at a chosen point.

    python killed_convert.py

A fork server: it imports moestream (seconds: mlx-lm, transformers) once and
runs nothing else, then for each JSON line on stdin, `{"point": [MODULE,
FUNCTION, N] or null, "args": [...]}`, forks a child that SIGKILLs itself at
the Nth call of MODULE.FUNCTION (null: never) while converting, and answers
`{"pid": PID}` at once and `{"rc": RC}` when the child is gone (RC as
subprocess gives it: minus the signal that ended it). A real SIGKILL: no
finally blocks, no atexit, no flushing; the test then checks what the
interrupted conversion left on disk.
"""

import importlib
import json
import os
import signal
import sys

from moestream.cli import main


def convert_killed_at(point: list | None, args: list[str]) -> None:
    """In the child: convert, SIGKILLing this process at `point`."""
    if point is not None:
        module, function, n = point
        target = importlib.import_module(module)
        original, calls = getattr(target, function), []

        def killer(*a, **kw):
            calls.append(1)
            if len(calls) == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*a, **kw)

        setattr(target, function, killer)
    sys.argv = ["moestream", "convert", *args]
    main()


def child(point: list | None, args: list[str]) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the pipes to the test are the server's alone
        os.dup2(null, fd)
    code = 0
    try:
        convert_killed_at(point, args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        code = 1
    os._exit(code)


def serve() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(job["point"], job["args"])
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"rc": rc}), flush=True)


if __name__ == "__main__":
    serve()
