"""Plain-text rendering for the CLI: sizes, tables, matrices."""

from __future__ import annotations

from tenplex.units import format_bytes as size

__all__ = ["size", "table", "matrix"]


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def matrix(cells: dict[tuple[int, int], int], n_src: int, n_dst: int, limit: int = 16) -> str:
    """Source-rank (rows) by target-rank (columns) bytes; ``-1`` rows are store reads."""
    srcs = sorted({s for s, _ in cells})
    if len(srcs) > limit or n_dst > limit:
        return f"({len(srcs)} x {n_dst} matrix omitted; use --json)"
    rows = [[("store" if s < 0 else f"src {s}")] + [size(cells.get((s, d), 0)) if cells.get((s, d))
                                                    else "." for d in range(n_dst)] for s in srcs]
    return table(rows, ["bytes"] + [f"dst {d}" for d in range(n_dst)])
