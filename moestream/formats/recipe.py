"""Quantization recipe: bits and group size per expert projection and layer range."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Bit widths mx.quantize supports in affine mode.
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
MODES = {"affine": None, "mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}


class RecipeError(ValueError):
    """A recipe string or dict that cannot be used."""


@dataclass(frozen=True)
class QuantSpec:
    bits: int
    group_size: int
    mode: str = "affine"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise RecipeError(
                f"Unknown quantization mode {self.mode!r}; use one of {sorted(MODES)}."
            )
        fixed = MODES[self.mode]
        if fixed is not None and (self.bits, self.group_size) != fixed:
            raise RecipeError(
                f"Mode {self.mode} needs bits={fixed[0]} and group size {fixed[1]}."
            )
        if fixed is None and self.bits not in AFFINE_BITS:
            raise RecipeError(
                f"Impossible bit width {self.bits}; use one of {list(AFFINE_BITS)}."
            )
        if fixed is None and self.group_size not in GROUP_SIZES:
            raise RecipeError(
                f"Impossible group size {self.group_size}; "
                f"use one of {list(GROUP_SIZES)}."
            )

    def to_mlx(self) -> dict[str, Any]:
        """The per-path dict mlx-lm's quantize_model and load_model understand."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantSpec:
        return cls(int(d["bits"]), int(d["group_size"]), str(d.get("mode", "affine")))


@dataclass(frozen=True)
class LayerOverride:
    """Bits for one projection on layers first..last (inclusive)."""

    projection: str
    first: int
    last: int
    bits: int


@dataclass(frozen=True)
class Recipe:
    """Bits per expert projection (optionally per layer range) plus the dense part.

    The dense part follows mlx-lm's `quantize_model`: `dense` for every
    quantizable module, except where the family's own `quant_predicate` says
    otherwise (the router stays at 8 bits in qwen3_moe).
    """

    experts: dict[str, int] = field(
        default_factory=lambda: {"gate_proj": 4, "up_proj": 4, "down_proj": 4}
    )
    group_size: int = 64
    overrides: tuple[LayerOverride, ...] = ()
    dense_bits: int = 4
    dense_group_size: int = 64

    def __post_init__(self) -> None:
        for bits in [*self.experts.values(), *(o.bits for o in self.overrides)]:
            QuantSpec(bits, self.group_size)
        QuantSpec(self.dense_bits, self.dense_group_size)
        for o in self.overrides:
            if o.first < 0 or o.last < o.first:
                raise RecipeError(
                    f"Bad layer range {o.first}-{o.last} for {o.projection}; "
                    "write FIRST-LAST with FIRST <= LAST."
                )

    @property
    def dense(self) -> QuantSpec:
        return QuantSpec(self.dense_bits, self.dense_group_size)

    def expert_spec(self, projection: str, layer: int) -> QuantSpec:
        """Bits for `projection` in MoE layer `layer` (last matching override wins)."""
        bits = self.experts.get(projection, self.dense_bits)
        for o in self.overrides:
            if o.projection == projection and o.first <= layer <= o.last:
                bits = o.bits
        return QuantSpec(bits, self.group_size)

    @classmethod
    def parse(
        cls,
        bits: str | None,
        group_size: int = 64,
        dense_bits: int = 4,
        base: Recipe | None = None,
    ) -> Recipe:
        """Parse `gate_proj=4,up_proj=4,down_proj=6,down_proj@0-3=8`.

        Entries override `base` (default: 4 bits everywhere); a plain `PROJ=BITS`
        also replaces base's layer ranges for PROJ. The dense part is base's.
        """
        if base is None:
            base = cls(
                group_size=group_size,
                dense_bits=dense_bits,
                dense_group_size=group_size,
            )
        experts = dict(base.experts)
        overrides = list(base.overrides)
        for item in bits.split(",") if bits else []:
            m = re.fullmatch(r"\s*(\w+)(?:@(\d+)-(\d+))?\s*=\s*(\d+)\s*", item)
            if m is None:
                raise RecipeError(
                    f"Cannot parse bits entry {item!r}; "
                    "write PROJ=BITS or PROJ@FIRST-LAST=BITS, e.g. down_proj=6."
                )
            proj, first, last, b = m.groups()
            if first is None:
                experts[proj] = int(b)
                overrides = [o for o in overrides if o.projection != proj]
            else:
                overrides.append(LayerOverride(proj, int(first), int(last), int(b)))
        return cls(
            experts,
            group_size,
            tuple(overrides),
            base.dense_bits,
            base.dense_group_size,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "experts": dict(sorted(self.experts.items())),
            "group_size": self.group_size,
            "overrides": [
                {
                    "projection": o.projection,
                    "first": o.first,
                    "last": o.last,
                    "bits": o.bits,
                }
                for o in self.overrides
            ],
            "dense_bits": self.dense_bits,
            "dense_group_size": self.dense_group_size,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        try:
            return cls(
                {str(k): int(v) for k, v in d["experts"].items()},
                int(d["group_size"]),
                tuple(LayerOverride(**o) for o in d.get("overrides", [])),
                int(d["dense_bits"]),
                int(d["dense_group_size"]),
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise RecipeError(f"Malformed recipe in manifest: {e}.") from e
