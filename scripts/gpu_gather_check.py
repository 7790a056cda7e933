"""Does gather_qmm's result depend on how many experts the weight stack holds?

    python scripts/gpu_gather_check.py

Same expert weights, same rows: once gathered from a stack of all E experts,
once from a stack of only the experts used (indices remapped). Equal on CPU;
prints, per row count and sorted/unsorted, whether it is equal here.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def main() -> None:
    E, D, F, k = 128, 2048, 768, 8
    mx.random.seed(0)
    w = mx.random.normal((E, F, D)).astype(mx.bfloat16) * 0.02
    wq, s, b = mx.quantize(w, 64, 4)
    for rows in (1, 8, 12, 32, 64):
        rng = np.random.default_rng(rows)
        idx = np.stack([rng.choice(E, k, replace=False) for _ in range(rows)])
        x = mx.random.normal((rows * k, 1, D)).astype(mx.bfloat16)
        for do_sort in (False, True):
            flat = idx.reshape(-1)
            order = np.argsort(flat, kind="stable") if do_sort else np.arange(flat.size)
            used = np.unique(flat)
            remap = np.zeros(E, np.uint32)
            remap[used] = np.arange(used.size)
            full = mx.gather_qmm(
                x[mx.array(order)],
                wq,
                s,
                b,
                rhs_indices=mx.array(flat[order]),
                transpose=True,
                group_size=64,
                bits=4,
                sorted_indices=do_sort,
            )
            sub = mx.gather_qmm(
                x[mx.array(order)],
                wq[mx.array(used)],
                s[mx.array(used)],
                b[mx.array(used)],
                rhs_indices=mx.array(remap[flat[order]]),
                transpose=True,
                group_size=64,
                bits=4,
                sorted_indices=do_sort,
            )
            # the rows of the first half of the experts only, as a grouped call
            half = np.isin(flat[order], used[: used.size // 2])
            part = mx.gather_qmm(
                x[mx.array(order[half])],
                wq,
                s,
                b,
                rhs_indices=mx.array(flat[order][half]),
                transpose=True,
                group_size=64,
                bits=4,
                sorted_indices=do_sort,
            )
            print(
                f"rows {rows * k:4d} sorted {do_sort}: fewer experts in the stack "
                f"equal {mx.array_equal(full, sub).item()}; half the rows equal "
                f"{mx.array_equal(full[mx.array(np.flatnonzero(half))], part).item()}"
            )


if __name__ == "__main__":
    main()
