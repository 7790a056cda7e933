"""Interrupted conversions: `OUT.partial/` and its journal of finished layers.

A conversion writes into `OUT.partial/` and renames it to OUT only when every
file is written, so OUT never exists half-made. After each MoE layer's blob is
written (temp name, fsync, rename), `journal.json` records the layer's
manifest entry, atomically. `--resume` reuses a journaled layer only if its
blob passes the same check as `moestream verify`, and only if the source and
the options are the ones the journal was started with.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

from .. import __version__
from ..formats import ExpertLayer, FormatError, Recipe
from ..formats.manifest import (
    layer_from_dict,
    layer_to_dict,
    validate_layer,
    write_atomic,
)
from ..formats.verify import check_blob
from .source import Source

log = logging.getLogger(__name__)

JOURNAL_NAME = "journal.json"
LOCK_NAME = ".lock"


class ResumeError(ValueError):
    """A partial conversion that cannot be resumed or must not be overwritten."""


def partial_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def fingerprint(
    src: Source, recipe: Recipe, dtype: str, layout: str = "rows"
) -> dict[str, Any]:
    """What must not change between an interrupted run and its --resume (the
    record layout only where blocked: a journal from before it resumes)."""
    files = sorted({*src.files.values(), src.path / "config.json"})
    blocked = {"layout": layout} if layout != "rows" else {}
    return blocked | {
        "moestream": __version__,
        "source": str(src.path.resolve()),
        "repo_id": src.repo_id,
        "revision": src.revision,
        "files": {
            str(f.relative_to(src.path)): [f.stat().st_size, f.stat().st_mtime_ns]
            for f in files
        },
        "config_crc32": zlib.crc32((src.path / "config.json").read_bytes()),
        "recipe": recipe.to_dict(),
        "dtype": dtype,
    }


class Journal:
    """The finished layers of `OUT.partial/`, held under an exclusive lock."""

    def __init__(self, directory: Path, print_: dict[str, Any]):
        self.directory = directory
        self.fingerprint = json.loads(json.dumps(print_))  # as the journal holds it
        self.layers: dict[int, ExpertLayer] = {}
        self._lock_fd = -1

    @classmethod
    def open(
        cls, directory: Path, print_: dict[str, Any], resume: bool
    ) -> tuple[Journal, dict[int, ExpertLayer]]:
        """Start or resume `directory`; return the journal and the reusable layers."""
        journal = cls(directory, print_)
        existed = directory.exists()
        if existed and not resume:
            raise ResumeError(
                f"{directory} holds an interrupted conversion; pass --resume to "
                "finish it, or remove it to start over."
            )
        (directory / "experts").mkdir(parents=True, exist_ok=True)
        journal._lock()
        try:
            reusable = journal._load() if existed else {}
        except BaseException:
            journal.close()
            raise
        journal.layers = dict(reusable)
        journal._save()
        journal._sweep()
        return journal, reusable

    def _sweep(self) -> None:
        """Remove everything but the reusable blobs: temp files, stale outputs."""
        keep = {JOURNAL_NAME, LOCK_NAME, "experts"}
        keep |= {entry.file for entry in self.layers.values()}
        for path in sorted(self.directory.rglob("*"), reverse=True):
            name = str(path.relative_to(self.directory))
            if name in keep:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()

    def _lock(self) -> None:
        self._lock_fd = os.open(self.directory / LOCK_NAME, os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self.close()
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise ResumeError(
                    f"Another convert-moe is writing {self.directory}; wait for it "
                    "to finish."
                ) from None
            raise

    def _load(self) -> dict[int, ExpertLayer]:
        path = self.directory / JOURNAL_NAME
        try:
            d = json.loads(path.read_text())
            old = d["fingerprint"]
            entries = [layer_from_dict(e) for e in d["layers"]]
        except FileNotFoundError:
            return {}  # killed before the first journal write: nothing to reuse
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ResumeError(
                f"{path} is unreadable ({e}); remove {self.directory} to start over."
            ) from None
        diff = sorted(
            k
            for k in {*old, *self.fingerprint}
            if old.get(k) != self.fingerprint.get(k)
        )
        if diff:
            raise ResumeError(
                f"{self.directory} was started with a different {', '.join(diff)}; "
                "resume with the same source and options, or remove it to start over."
            )
        reusable = {}
        for entry in entries:
            if self._intact(entry):
                reusable[entry.layer] = entry
            else:
                log.warning(
                    "layer %d in %s is damaged: converting it again",
                    entry.layer,
                    self.directory,
                )
        return reusable

    def _intact(self, entry: ExpertLayer) -> bool:
        try:
            validate_layer(entry, f"layer {entry.layer}")
        except FormatError:
            return False
        return not check_blob(self.directory, entry)

    def record(self, entry: ExpertLayer) -> None:
        """`entry`'s blob is written and fsynced: make that durable in the journal."""
        self.layers[entry.layer] = entry
        self._save()

    def _save(self) -> None:
        layers = [layer_to_dict(self.layers[k]) for k in sorted(self.layers)]
        data = {"fingerprint": self.fingerprint, "layers": layers}
        write_atomic(self.directory / JOURNAL_NAME, json.dumps(data, indent=1).encode())

    def finish(self) -> None:
        """All written: drop the journal so `directory` is the plain output."""
        (self.directory / JOURNAL_NAME).unlink(missing_ok=True)
        (self.directory / LOCK_NAME).unlink(missing_ok=True)
        self.close()

    def abandon(self) -> bool:
        """After a failure: keep the directory if it holds finished layers."""
        keep = bool(self.layers)
        self.close()
        if not keep:
            shutil.rmtree(self.directory, ignore_errors=True)
        return keep

    def close(self) -> None:
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = -1
