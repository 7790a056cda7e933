"""The counters of one loaded model, and its per-call trace when recording."""

from __future__ import annotations

import threading
from dataclasses import MISSING, dataclass, field, fields

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from . import native


@dataclass
class RuntimeStats:
    """Counters of one loaded model; read with `moestream.stats(model)`."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_read: int = 0  # read from the blobs
    # Copied into slots, one record a slot miss: from the blob, or from the
    # native engine's host tier (on a GPU, over the bus).
    fill_bytes: int = 0
    grouped_calls: int = 0
    # Calls computed with the fast arithmetic (RuntimeConfig.arithmetic).
    fast_calls: int = 0
    # Decode calls of layers that hold every expert: no read, no host sync.
    sync_free_calls: int = 0
    # Calls whose slots the native engine resolved inside the stream.
    native_calls: int = 0
    # ... of them, on a GPU, by a kernel (RuntimeConfig.device_resolve).
    device_calls: int = 0
    # Prefetch (native engine): experts predicted for the next layer, not resident.
    prefetched: int = 0
    prefetched_used: int = 0  # ... that the next layer routed to
    prefetch_bytes: int = 0
    misses_prefetched: int = 0  # misses whose record had been prefetched
    # CPU slot misses the CPU kernel filled as it read their records in place
    # (their records in the page cache: no read into the slot first).
    kernel_fills: int = 0
    # Calls with more pairs than slots computed from the records in place,
    # no slot written (CPU slots that fill in the kernel; else grouped_calls).
    in_place_calls: int = 0
    # The native engine's host tier: slot misses whose record it held (read
    # ahead or kept), still being read ahead, or read from the blob then.
    host_hits: int = 0
    host_late: int = 0
    host_misses: int = 0
    host_evictions: int = 0
    per_layer_misses: dict[int, int] = field(default_factory=dict)
    # Per MoE layer, per expert: the calls that routed to it (a hit or a miss
    # each; not counted by calls of a layer that holds every expert for good).
    expert_uses: dict[int, np.ndarray] = field(default_factory=dict)
    # With RuntimeConfig.record_trace: one event per MoE layer call (`events`).
    recording: bool = False
    _events: list[dict] = field(default_factory=list, repr=False)
    _steps: dict[int, int] = field(default_factory=dict, repr=False)
    # (layer, step) -> a native call's event, until its cache's record fills it.
    _pending: dict[tuple[int, int], dict] = field(default_factory=dict, repr=False)
    # Native expert caches and host tier, whose counters `collect` folds in.
    native: list = field(default_factory=list, repr=False)
    # Layer -> its native expert cache, whose call records fill `events`.
    native_layers: dict[int, object] = field(default_factory=dict, repr=False)
    # `collect` runs in any thread (/metrics, the page's stream): one at a time.
    _collecting: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def host_hit_rate(self) -> float:
        """Slot misses the host tier served without a read of its own."""
        total = self.host_hits + self.host_late + self.host_misses
        return (self.host_hits + self.host_late) / total if total else 0.0

    @property
    def prefetch_precision(self) -> float:
        return self.prefetched_used / self.prefetched if self.prefetched else 0.0

    @property
    def prefetch_recall(self) -> float:
        return self.misses_prefetched / self.misses if self.misses else 0.0

    @property
    def wasted_bytes(self) -> int:
        per = self.prefetch_bytes / self.prefetched if self.prefetched else 0
        return int((self.prefetched - self.prefetched_used) * per)

    def used(self, layer: int, experts: np.ndarray, num_experts: int) -> None:
        """One call of `layer` routed to `experts` (unique ids)."""
        self._uses(layer, num_experts)[experts] += 1

    def next_step(self, layer: int) -> int:
        """The step `record` gives this layer's next call: the id the native
        cache records that call's counts under (-1 when not recording)."""
        return self._steps.get(layer, 0) if self.recording else -1

    def record(
        self,
        layer: int,
        experts: np.ndarray | mx.array,
        hits: int | None,
        misses: int | None,
        prefetched: list[int],
        bytes_read: int | None,
    ) -> None:
        """One MoE layer call, when recording. `experts` may be an unevaluated
        mx.array, read only when `events` is, so recording adds no host sync.
        `hits` None with `misses` 0: every distinct expert hit (sync-free
        calls); all three None: counted by the layer's native cache, which
        records them under this call's step (`next_step`)."""
        if not self.recording:
            return
        step = self._steps.get(layer, 0)
        self._steps[layer] = step + 1
        event = {
            "layer": layer,
            "step": step,  # this layer's call count since the last reset
            "tokens": experts.size // experts.shape[-1],
            "experts": experts,
            "hits": hits,
            "misses": misses,
            "prefetched": sorted(prefetched),
            "bytes_read": bytes_read,
        }
        self._events.append(event)
        if hits is None and misses is None and bytes_read is None:
            self._pending[(layer, step)] = event

    @property
    def events(self) -> list[dict]:
        """One dict per MoE layer call since the last reset (empty unless
        `record_trace`): layer, step, tokens, experts (routed, flattened),
        hits and misses (distinct experts), prefetched (experts prefetched for
        this layer since its previous call), bytes_read (read from the blob
        for this call's misses; a host tier's reads ahead are not). A native
        call that never ran (its output not evaluated, or a read failed)
        keeps hits, misses and bytes_read None."""
        if self._pending:
            self._fill_native()
        for e in self._events:
            if not isinstance(e["experts"], list):
                flat = np.array(e["experts"]).reshape(-1)
                e["experts"] = flat.tolist()
                if e["hits"] is None and e["misses"] == 0:
                    e["hits"] = len(np.unique(flat))
        return self._events

    def _fill_native(self) -> None:
        """Fill the native calls' events from their caches' call records."""
        _synchronize()  # calls still in flight record when they finish
        for layer, cache in self.native_layers.items():
            for step, hits, misses, nbytes, prefetched in cache.take_records():
                e = self._pending.pop((layer, step), None)
                if e is not None:
                    e.update(hits=hits, misses=misses, bytes_read=nbytes)
                    e["prefetched"] = sorted(prefetched)

    def routing(self) -> dict[int, np.ndarray]:
        """The recorded trace: per MoE layer, one row of expert ids per token."""
        rows: dict[int, list[np.ndarray]] = {}
        for e in self.events:
            routed = np.array(e["experts"], np.int64).reshape(e["tokens"], -1)
            rows.setdefault(e["layer"], []).append(routed)
        return {layer: np.concatenate(r) for layer, r in rows.items()}

    def collect(self) -> RuntimeStats:
        """Fold in what the native caches counted since the last collect."""
        with self._collecting:
            layer_of = {id(c): layer for layer, c in self.native_layers.items()}
            for cache in self.native:
                counts = cache.take_counters()
                for name, value in counts.items():
                    setattr(self, name, getattr(self, name) + value)
                if id(cache) in layer_of:
                    self._collect_layer(layer_of[id(cache)], cache, counts["misses"])
        return self

    def _collect_layer(self, layer: int, cache: object, misses: int) -> None:
        """A native layer's own counts: its misses, each expert's uses."""
        uses = np.array(native.take_uses(cache), np.int64)
        self._uses(layer, uses.size)[:] += uses
        if misses:
            self.per_layer_misses[layer] = self.per_layer_misses.get(layer, 0) + misses

    def _uses(self, layer: int, num_experts: int) -> np.ndarray:
        uses = self.expert_uses.get(layer)
        if uses is None:
            uses = self.expert_uses[layer] = np.zeros(num_experts, np.int64)
        return uses

    def reset(self) -> None:
        self.collect()
        if self.recording and self.native_layers:
            _synchronize()  # no call in flight records under an old step
            for cache in self.native_layers.values():
                cache.take_records()
        for f in fields(self):
            if f.name not in ("recording", "native", "native_layers", "_collecting"):
                default = f.default_factory if f.default is MISSING else None
                setattr(self, f.name, default() if default else f.default)

    def as_dict(self) -> dict:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "bytes_read": self.bytes_read,
            "fill_bytes": self.fill_bytes,
            "kernel_fills": self.kernel_fills,
            "in_place_calls": self.in_place_calls,
            "hit_rate": self.hit_rate,
            "prefetched": self.prefetched,
            "prefetch_precision": self.prefetch_precision,
            "prefetch_recall": self.prefetch_recall,
            "prefetch_wasted_bytes": self.wasted_bytes,
            "sync_free_calls": self.sync_free_calls,
            "fast_calls": self.fast_calls,
            "native_calls": self.native_calls,
            "device_calls": self.device_calls,
            "host_hits": self.host_hits,
            "host_late": self.host_late,
            "host_misses": self.host_misses,
            "host_evictions": self.host_evictions,
            "host_hit_rate": self.host_hit_rate,
        }


def _synchronize() -> None:
    """Wait for the default stream and mlx-lm's generation stream, where its
    generate_step computes one step ahead (calls that record when they run)."""
    mx.synchronize()
    mx.synchronize(generation_stream)
