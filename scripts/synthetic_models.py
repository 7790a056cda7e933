"""Write the benchmark's synthetic Qwen3-MoE models straight into format v1.

    python scripts/synthetic_models.py small build/bench-small [--export-mlx DIR]

small: 16 layers x 64 experts, top-8, hidden 1024 (~1 GB of experts);
medium: 24 x 128, hidden 2048 (~8 GB); large: 48 x 256 (~33 GB, bigger than
a 24 GB machine's RAM). Refuses when the disk under OUT lacks the space.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from moestream.bench.models import SCALES, export_mlx, write_synthetic
from moestream.units import human_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("scale", choices=sorted(SCALES))
    p.add_argument("out", type=Path)
    p.add_argument("--export-mlx", type=Path, help="also write an mlx-lm directory")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    scale = SCALES[a.scale]
    need = scale.expert_bytes() * (2 if a.export_mlx else 1) * 1.05
    a.out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(a.out.parent).free
    if free < need:
        sys.exit(
            f"error: skipped {a.scale}: it needs {human_bytes(int(need))} of disk, "
            f"{human_bytes(free)} free under {a.out.parent}."
        )
    start = time.perf_counter()
    manifest = write_synthetic(a.out, scale, seed=a.seed)
    print(
        f"wrote {a.out}: {human_bytes(manifest.expert_bytes)} of experts in "
        f"{time.perf_counter() - start:.0f} s"
    )
    if a.export_mlx:
        export_mlx(a.out, a.export_mlx)
        print(f"wrote {a.export_mlx} (mlx-lm layout)")


if __name__ == "__main__":
    main()
