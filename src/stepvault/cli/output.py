"""How the commands print tables: whole identifiers, plain text in a pipe.

A rich Table squeezes its columns to the terminal's width and cuts what does not fit
(``optimize…``), and in a pipe rich assumes 80 columns and draws boxes. :func:`print_table`
draws the table only on a terminal wide enough for every cell at its natural width;
otherwise (a pipe, a file, a narrow terminal) it writes plain aligned lines, each cell
whole, with no box characters and no colour, so identifiers are never truncated and the
output greps and cuts like any text.
"""

from __future__ import annotations

import sys

from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from .common import console


def _cell_text(cell: object) -> str:
    if isinstance(cell, Text):
        return cell.plain
    if isinstance(cell, str):
        return Text.from_markup(cell).plain
    return str(cell)


def plain_lines(table: Table) -> list[str]:
    """``table`` as plain aligned lines: its title, a header line and one line per row; each
    cell whole (the last column is not padded)."""
    headers = [_cell_text(c.header) for c in table.columns]
    columns = [[_cell_text(cell) for cell in c.cells] for c in table.columns]
    rows = [list(r) for r in zip(*columns)] if columns else []
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    right = [c.justify == "right" for c in table.columns]

    def line(cells: list[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            last = i == len(cells) - 1
            if right[i]:
                out.append(cell.rjust(widths[i]))
            else:
                out.append(cell if last else cell.ljust(widths[i]))
        return "  ".join(out).rstrip()

    lines = [_cell_text(table.title)] if table.title else []
    if table.show_header and any(headers):
        lines.append(line(headers))
    lines += [line(r) for r in rows]
    return lines


def fits(table: Table) -> bool:
    """Whether ``table`` fits the console with every cell at its natural width."""
    # measured without the console's limit (which would cap the answer at its width)
    measured = Measurement.get(console, console.options.update_width(1 << 20), table)
    return measured.maximum <= console.width


def print_table(table: Table) -> None:
    """Draw ``table`` on a terminal wide enough for it; else print it as plain lines."""
    if console.is_terminal and fits(table):
        console.print(table)
        return
    sys.stdout.write("\n".join(plain_lines(table)) + "\n")
    sys.stdout.flush()
