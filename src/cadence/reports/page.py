"""The pieces of cadence's self-contained HTML pages (``cadence report`` of a model dir and of a
sweep dir): the style sheet, escaping, cells, tables and times (where they are written:
:mod:`cadence.reports.outputs`)."""

from __future__ import annotations

import datetime
import html
import json
import math
from typing import Any, Iterable

__all__ = ["PAGE_CSS", "escape", "format_cell", "format_time", "html_table"]

# The style of every page.
PAGE_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;background:#f6f7f9;color:#1d232b}
main{max-width:1240px;margin:0 auto;padding:20px 28px 48px}
h1{font-size:22px;margin:8px 0 2px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d5d9df;padding-bottom:4px}
.sub{color:#5b6470;margin:0 0 14px;font-size:13px;word-break:break-all}
table{border-collapse:collapse;background:#fff;font-size:13px;margin:4px 0 10px}
th,td{border:1px solid #dde1e6;padding:4px 9px;text-align:left;vertical-align:top}
th{background:#eef0f3;font-weight:600}td{font-variant-numeric:tabular-nums}
table.facts th{width:190px}
.ok{color:#1b7a2e;font-weight:600}.warn{color:#9a5b00;font-weight:600}
img.plots{max-width:100%;background:#fff;border:1px solid #dde1e6}
pre{background:#fff;border:1px solid #dde1e6;padding:10px 12px;font-size:12px;overflow-x:auto}
.empty{color:#5b6470;font-style:italic}
"""


def escape(value: Any) -> str:
    """``value`` as HTML text (quotes escaped too)."""
    return html.escape(str(value), quote=True)


def format_time(t: Any) -> str:
    """A UNIX time as local date and time with its zone; ``""`` for anything else."""
    if not isinstance(t, (int, float)) or not math.isfinite(t):
        return ""
    return datetime.datetime.fromtimestamp(t).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def format_cell(value: Any) -> str:
    """A table cell's text: floats to 6 significant digits, mappings and lists as JSON, None empty."""
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=str)
    return str(value)


def html_table(headers: Iterable[str], rows: Iterable[Iterable[Any]], css: str = "") -> str:
    """An HTML table; every header and cell escaped (cells are plain values)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(format_cell(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{escape(css)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
