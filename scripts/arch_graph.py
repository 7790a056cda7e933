"""Draw moestream's import graph as an SVG (docs/architecture.svg).

    python scripts/arch_graph.py [docs/architecture.svg]

Nodes are the packages above the engine (cli, serve, bench, converter,
formats) and each module of the runtime and of the top level; an arrow
A -> B means A imports B. Rows are layers: a node sits one row below the
lowest of those importing it. tests/test_docs.py redraws it and compares, so
the picture keeps step with the code.
"""

from __future__ import annotations

import ast
import sys
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "moestream"
# Packages drawn as one node each; everything else is one node per module.
COLLAPSED = ("cli", "serve", "bench", "converter", "formats")
HIDDEN = ("__init__", "__main__", "units", "errors", "options")
BOX_W, BOX_H, GAP_X, GAP_Y = 118, 30, 14, 46


def node_of(module: str) -> str | None:
    """`moestream.runtime.loader` -> "runtime/loader"; None for hidden ones."""
    parts = module.split(".")[1:]
    if not parts:
        return None
    if parts[0] in COLLAPSED:
        return parts[0]
    if parts[-1] in HIDDEN or parts[0] == "_native":
        return None
    return "/".join(parts)


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        out[".".join(rel.parts)] = path
    return out


def _imported(module: str, path: Path) -> set[str]:
    """Absolute names of the moestream modules `module` imports."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # annotations only: not an import at run time
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            node.body = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("moestream")}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("moestream"):
                found.add(name)
                found |= {f"{name}.{a.name}" for a in node.names}
    return found


def edges() -> tuple[list[str], set[tuple[str, str]]]:
    """The graph's nodes (sorted) and arrows, between distinct nodes."""
    mods = modules()
    nodes = {n for m in mods if (n := node_of(m))}
    arrows = set()
    for module, path in mods.items():
        src = node_of(module)
        if src is None:
            continue
        for name in _imported(module, path):
            if name not in mods:
                continue
            dst = node_of(name)
            if dst and dst != src:
                arrows.add((src, dst))
    return sorted(nodes), arrows


def rows(nodes: list[str], arrows: set[tuple[str, str]]) -> list[list[str]]:
    """Nodes by layer: each one row below the lowest of its importers."""
    depth = {n: 0 for n in nodes}
    for _ in nodes:  # longest path from the top; the graph is acyclic
        for a, b in sorted(arrows):
            depth[b] = max(depth[b], depth[a] + 1)
    if max(depth.values()) >= len(nodes):
        raise ValueError("the import graph has a cycle")
    layers: list[list[str]] = [[] for _ in range(max(depth.values()) + 1)]
    for n in nodes:
        layers[depth[n]].append(n)
    return layers


def svg(nodes: list[str], arrows: set[tuple[str, str]]) -> str:
    layers = rows(nodes, arrows)
    widest = max(len(r) for r in layers)
    width = widest * (BOX_W + GAP_X) + GAP_X
    height = len(layers) * (BOX_H + GAP_Y) + GAP_Y
    at = {}
    for y, row in enumerate(layers):
        left = (width - len(row) * (BOX_W + GAP_X) + GAP_X) / 2
        for x, n in enumerate(row):
            at[n] = (left + x * (BOX_W + GAP_X), GAP_Y / 2 + y * (BOX_H + GAP_Y))
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
        f'height="{height:.0f}" font-family="sans-serif" font-size="12">',
        '<defs><marker id="a" viewBox="0 0 8 8" refX="8" refY="4" '
        'markerWidth="6" markerHeight="6" orient="auto">'
        '<path d="M0,0 L8,4 L0,8 z" fill="#888"/></marker></defs>',
    ]
    for a, b in sorted(arrows):
        (xa, ya), (xb, yb) = at[a], at[b]
        out.append(
            f'<line x1="{xa + BOX_W / 2:.0f}" y1="{ya + BOX_H:.0f}" '
            f'x2="{xb + BOX_W / 2:.0f}" y2="{yb:.0f}" stroke="#bbb" '
            'marker-end="url(#a)"/>'
        )
    for n in nodes:
        x, y = at[n]
        fill = "#dbe8f7" if n.startswith("runtime/") else "#eeeeee"
        out.append(
            f'<rect x="{x:.0f}" y="{y:.0f}" width="{BOX_W}" height="{BOX_H}" '
            f'rx="4" fill="{fill}" stroke="#666"/>'
            f'<text x="{x + BOX_W / 2:.0f}" y="{y + BOX_H / 2 + 4:.0f}" '
            f'text-anchor="middle">{escape(n)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs/architecture.svg"
    target.write_text(svg(*edges()))
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
