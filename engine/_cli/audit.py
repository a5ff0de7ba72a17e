"""``engine audit`` and ``engine diff`` as the command prints them: a table per verifier, or JSON."""

from __future__ import annotations

import math

import click
import orjson
from rich.table import Table
from rich.text import Text

from engine._backfill.audit import Agreement, AuditReport, DiffReport
from engine._cli.render import stdout

__all__ = ["show_agreements"]


def _number(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.4g}"


def _provenance(provenance: object) -> str:
    return "-" if provenance is None else orjson.dumps(provenance, option=orjson.OPT_SORT_KEYS).decode()


def _table(verifiers: tuple[Agreement, ...], tolerance: float, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for name in ("environment", "kind", "rows", "changed", "compared", "equal", "mean |diff|", "max |diff|",
                 "1->1 1->0 0->1 0->0", "noise mean/max", "agrees"):
        table.add_column(name, justify="left" if name in ("environment", "kind") else "right", overflow="fold")
    for v in verifiers:
        confusion = v.confusion
        counts = "-" if confusion is None else (
            f"{confusion.one_one} {confusion.one_zero} {confusion.zero_one} {confusion.zero_zero}")
        noise = "-" if v.repeat == 1 else f"{_number(v.noise_mean)}/{_number(v.noise_max)}"
        ok = Text("yes", style="green") if v.agrees(tolerance) else Text("NO", style="bold red")
        table.add_row(Text(v.environment), Text(v.kind), f"{v.rows:,}", f"{v.provenance_changed:,}",
                      f"{v.compared:,}", f"{v.equal:,}", _number(v.mean_abs_diff), _number(v.max_abs_diff),
                      counts, noise, ok)
    return table


def show_agreements(report: AuditReport | DiffReport, *, as_json: bool) -> None:
    """Print ``report``: its JSON, or a table per verifier and a line for each verifier whose provenance changed."""
    if as_json:
        click.echo(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2).decode())
        return
    if isinstance(report, AuditReport):
        title = (f"{report.sampled:,} of {report.rows:,} rows of {report.output} scored again (seed {report.seed}), "
                 f"tolerance {report.tolerance:g}")
    else:
        title = (f"{report.matched:,} rows matched: {report.a} ({report.rows_a:,} rows) against {report.b} "
                 f"({report.rows_b:,} rows), tolerance {report.tolerance:g}")
    stdout.print(_table(report.verifiers, report.tolerance, title))
    for v in report.verifiers:
        if v.provenance_changed:
            then = "now" if isinstance(report, AuditReport) else f"in {report.b}"
            stdout.print(f"{v.environment}: provenance changed on {v.provenance_changed:,} of {v.rows:,} rows, not "
                         f"compared: recorded {_provenance(v.stored_provenance)}, {then} "
                         f"{_provenance(v.current_provenance)}", soft_wrap=True, markup=False)
    if isinstance(report, DiffReport) and (report.only_a or report.only_b):
        stdout.print(f"unmatched: {report.only_a:,} rows only in {report.a}, {report.only_b:,} only in {report.b}",
                     soft_wrap=True, markup=False)
    disagree = [v.environment for v in report.verifiers if not v.agrees(report.tolerance)]
    if disagree:
        stdout.print(f"disagree beyond tolerance {report.tolerance:g}: {', '.join(disagree)}", soft_wrap=True,
                     markup=False)
    else:
        stdout.print("every compared verifier agrees", soft_wrap=True, markup=False)
