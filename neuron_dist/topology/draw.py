"""Draw one node's chip graph and ring(s) as SVG (no plotting library needed)."""
from __future__ import annotations

from typing import Sequence

from .instances import InstanceModel

COLOURS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd")


def _pos(inst: InstanceModel, chip: int, cell: int, margin: int) -> tuple[float, float]:
    if inst.graph in ("torus",) and len(inst.torus_dims) == 2:
        r, c = inst.chip_coords(chip)
        return margin + c * cell, margin + r * cell
    return margin + chip * cell, margin + cell / 2      # ring / switch / single: one row


def svg(inst: InstanceModel, rings: Sequence[Sequence[int]] = (), lnc: int | None = None,
        title: str = "") -> str:
    """SVG text: chips as boxes (with their logical cores), links as grey lines (wrap-around links
    as arcs outside the grid), and each ring of chips as a coloured cycle."""
    cell, margin = 110, 70
    pos = {c: _pos(inst, c, cell, margin) for c in range(inst.chips)}
    w = max(x for x, _ in pos.values()) + margin + 40
    h = max(y for _, y in pos.values()) + margin + 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0f}" height="{h:.0f}" '
           f'font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="10" y="18" font-size="14">{title or inst.name}</text>']
    seen = set()
    for a in range(inst.chips):
        for b in inst.chip_neighbours(a):
            e = frozenset((a, b))
            if e in seen or inst.graph == "switch":
                continue
            seen.add(e)
            (x1, y1), (x2, y2) = pos[a], pos[b]
            if abs(x1 - x2) + abs(y1 - y2) > cell * 1.5:     # wrap-around link
                mx, my = (x1 + x2) / 2, (y1 + y2) / 2
                dx, dy = (0, -cell * 0.6) if y1 == y2 else (-cell * 0.6, 0)
                out.append(f'<path d="M{x1},{y1} Q{mx + dx},{my + dy} {x2},{y2}" fill="none" '
                           f'stroke="#bbb" stroke-dasharray="4 3"/>')
            else:
                out.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#bbb" '
                           f'stroke-width="6"/>')
    for i, ring in enumerate(rings):
        col = COLOURS[i % len(COLOURS)]
        off = (i - (len(rings) - 1) / 2) * 8
        for j in range(len(ring)):
            a, b = ring[j], ring[(j + 1) % len(ring)]
            if a == b:
                continue
            (x1, y1), (x2, y2) = pos[a], pos[b]
            out.append(f'<line x1="{x1 + off}" y1="{y1 + off}" x2="{x2 + off}" y2="{y2 + off}" '
                       f'stroke="{col}" stroke-width="2.5" opacity="0.85"/>')
        out.append(f'<text x="10" y="{h - 30 + 14 * i}" fill="{col}">ring {i}: '
                   f'{" ".join(map(str, ring))}</text>')
    cpc = inst.cores_per_chip(lnc)
    for c, (x, y) in pos.items():
        out.append(f'<rect x="{x - 28}" y="{y - 20}" width="56" height="40" rx="5" '
                   f'fill="#f4f4f4" stroke="#333"/>')
        out.append(f'<text x="{x}" y="{y - 4}" text-anchor="middle">chip {c}</text>')
        out.append(f'<text x="{x}" y="{y + 12}" text-anchor="middle" fill="#555">cores '
                   f'{c * cpc}-{c * cpc + cpc - 1}</text>')
    out.append("</svg>")
    return "\n".join(out)
