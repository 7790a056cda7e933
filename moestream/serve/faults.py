"""Expert records that failed their read or checksum while serving.

The engine never keeps a record that failed: the next call routed to it reads
it again. So the server only has to fail the request that hit it, say which
record it was (/health, /metrics, the error body), and notice when the bytes
on disk are good again: a bad record is checked against its manifest checksum
when asked about, at most once a CHECK_INTERVAL, and leaves the list once it
passes.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..formats import checksum, load_manifest
from ..formats.manifest import inside
from ..runtime import ExpertReadError

# Seconds between two checks of the bad records on disk (/health, /metrics ask).
CHECK_INTERVAL = 0.5
# Both engines name a record "[Ee]xpert E of layer L" in their read errors.
RECORD = re.compile(r"xpert (\d+) of layer (\d+)")


@dataclass(frozen=True)
class BadRecord:
    layer: int
    expert: int
    file: str  # relative to the model directory
    error: str

    def as_dict(self) -> dict:
        return {
            "layer": self.layer,
            "expert": self.expert,
            "file": self.file,
            "error": self.error,
        }


def record_of(error: BaseException) -> tuple[int, int] | None:
    """(layer, expert) an ExpertReadError names, if it names one."""
    found = RECORD.search(str(error))
    return (int(found[2]), int(found[1])) if found else None


class RecordFaults:
    """The read errors a server met and the records still bad on disk."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._layers = {layer.layer: layer for layer in load_manifest(directory).layers}
        self._lock = threading.Lock()
        self._bad: dict[tuple[int, int], BadRecord] = {}
        self._checked = 0.0
        self.read_errors = 0  # read errors met while serving
        self.failed_requests = 0
        self.repaired = 0  # records that were bad and read good again on disk

    def report(self, error: ExpertReadError) -> None:
        """Count `error` once, however many requests it fails; mark its record."""
        with self._lock:
            if getattr(error, "counted", False):
                return
            error.counted = True  # type: ignore[attr-defined]
            self.read_errors += 1
            key = record_of(error)
            if key is not None and key[0] in self._layers:
                file = self._layers[key[0]].file
                self._bad[key] = BadRecord(*key, file, _one_line(error))

    def failed(self, error: ExpertReadError) -> str:
        """Count a request that `error` failed; the message to answer it with."""
        self.report(error)
        with self._lock:
            self.failed_requests += 1
        return (
            f"{_one_line(error)} Check the model with `moestream verify "
            f"{self.directory}`; a record repaired on disk is read again, "
            "no restart needed."
        )

    def bad(self) -> list[BadRecord]:
        """The records still bad, each checked on disk again (rate-limited)."""
        with self._lock:
            now = time.monotonic()
            if self._bad and now - self._checked >= CHECK_INTERVAL:
                self._checked = now
                for key in [k for k in self._bad if self._intact(*k)]:
                    del self._bad[key]
                    self.repaired += 1
            return sorted(self._bad.values(), key=lambda b: (b.layer, b.expert))

    def _intact(self, layer: int, expert: int) -> bool:
        """Whether the record's bytes on disk match the manifest's checksum."""
        spec = self._layers[layer]
        try:
            fd = os.open(inside(self.directory, spec.file), os.O_RDONLY)
            try:
                offset = spec.data_offset + expert * spec.stride
                data = os.pread(fd, spec.record_nbytes, offset)
            finally:
                os.close(fd)
        except (OSError, ValueError):
            return False
        return (
            len(data) == spec.record_nbytes and checksum(data) == spec.checksums[expert]
        )


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
