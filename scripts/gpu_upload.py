"""Ways to bring expert records into GPU slot arrays, timed side by side.

Each way reads `--records` random records of one MoE layer from OUT (page
cache warm) into slots and then runs a GPU kernel that reads those slots,
timed until that kernel is done: the time to the first use, which is what a
miss costs. Medians over `--repeats` interleaved rounds, per record.

- direct: `preadv` straight into the slot arrays' memory (the runtime's way;
  on CUDA that memory is managed, so the GPU's first touch migrates it).
- staged: `preadv` into one persistent host buffer per segment, then
  `mx.array(buffer)` and an in-place slot update on the GPU, per record.
- batched: as staged, but all records of the round in one host buffer, one
  array and one scatter update per segment.
- device: the slot update from arrays already on the GPU (the lower bound).

    python scripts/gpu_upload.py OUT [--records 8] [--repeats 5] [--slots 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from moestream.formats import load_manifest
from moestream.runtime.store import RAW_DTYPES, ExpertStore, SlotFiller


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("--records", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--slots", type=int, default=32)
    a = p.parse_args()
    manifest = load_manifest(a.out)
    store = ExpertStore(a.out, manifest, verify=False)
    layer = manifest.layers[0]
    segs = layer.segments
    dtypes = [getattr(mx, s.dtype) for s in segs]
    rng = np.random.default_rng(0)
    n = a.records

    def fresh_slots() -> list[mx.array]:
        s = [
            mx.zeros((a.slots, *g.shape), d) for g, d in zip(segs, dtypes, strict=True)
        ]
        mx.eval(s)
        return s

    def use(slots: list[mx.array], rows: list[int]) -> None:
        idx = mx.array(rows)
        mx.eval([s[idx].view(mx.uint8).astype(mx.uint32).sum() for s in slots])

    def host_buffers(count: int) -> list[np.ndarray]:
        return [
            np.zeros((count, *g.shape), np.dtype(RAW_DTYPES[d.size]))
            for g, d in zip(segs, dtypes, strict=True)
        ]

    def read_into(bufs: list[np.ndarray], i: int, expert: int) -> None:
        order = sorted(range(len(segs)), key=lambda j: segs[j].offset)
        views, pos = [], 0
        pad = bytearray(layer.record_nbytes)
        for j in order:
            if segs[j].offset > pos:
                views.append(memoryview(pad)[pos : segs[j].offset])
            views.append(memoryview(bufs[j][i]).cast("B"))
            pos = segs[j].offset + segs[j].nbytes
        store.readv(layer.layer, expert, views)

    def as_mx(buf: np.ndarray, dtype: mx.Dtype) -> mx.array:
        return mx.array(buf).view(dtype)

    def direct(slots, experts, rows):
        filler = SlotFiller(store, layer, slots)
        for e, r in zip(experts, rows, strict=True):
            filler.fill(int(e), r)

    one = host_buffers(1)

    def staged(slots, experts, rows):
        for e, r in zip(experts, rows, strict=True):
            read_into(one, 0, int(e))
            for j, d in enumerate(dtypes):
                slots[j][r] = as_mx(one[j][0], d)
            mx.eval(slots)

    many = host_buffers(n)

    def batched(slots, experts, rows):
        for i, e in enumerate(experts):
            read_into(many, i, int(e))
        idx = mx.array(rows)
        for j, d in enumerate(dtypes):
            slots[j][idx] = as_mx(many[j], d)
        mx.eval(slots)

    on_device = [
        mx.contiguous(mx.ones((n, *g.shape), d))
        for g, d in zip(segs, dtypes, strict=True)
    ]
    mx.eval(on_device)

    def device(slots, experts, rows):
        idx = mx.array(rows)
        for j in range(len(slots)):
            slots[j][idx] = on_device[j]
        mx.eval(slots)

    ways = {"direct": direct, "staged": staged, "batched": batched, "device": device}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(a.repeats + 1):  # the first round warms the kernels up
        for name, way in ways.items():
            slots = fresh_slots()
            use(slots, list(range(a.slots)))  # slots start on the GPU
            experts = rng.choice(layer.num_experts, n, replace=False)
            rows = sorted(rng.choice(a.slots, n, replace=False).tolist())
            for e in experts:  # page cache warm: time the upload, not the disk
                store.readv(layer.layer, int(e), [bytearray(layer.record_nbytes)])
            start = time.perf_counter()
            way(slots, experts, rows)
            use(slots, rows)
            if r:
                times[name].append((time.perf_counter() - start) / n)
    mb = layer.record_nbytes / 1e6
    print(
        f"{mb:.2f} MB records, {n} per round, {a.repeats} rounds, "
        f"device {mx.default_device()}"
    )
    base = statistics.median(times["device"])
    for name, t in times.items():
        med = statistics.median(t)
        print(
            f"{name:8s} {med * 1e6:8.0f} us/record  {mb / med / 1e3:6.2f} GB/s  "
            f"{med / base:6.1f}x device"
        )


if __name__ == "__main__":
    main()
