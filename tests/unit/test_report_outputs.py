"""Issue 39 (data loss): a report's page and PNG replace only a report cadence wrote -- marked by its
generator (the page's ``<meta name="generator">``, the PNG's ``Software`` text chunk), or, written before
the mark, a page with cadence's title and the PNG that page embeds. Anything else is refused before
anything is written (ConfigError, exit 2)."""

from __future__ import annotations

import base64
import io
import os
import struct
import zlib
from pathlib import Path

import pytest

from cadence.errors import ConfigError
from cadence.reports.outputs import HTML_GENERATOR, PNG_METADATA, check_report_targets, write_report

pytest.importorskip("matplotlib")


def png(metadata: dict[str, str] | None = None) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1, 1), dpi=20)
    FigureCanvasAgg(fig)
    fig.subplots().plot([0, 1])
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata=metadata)
    return buffer.getvalue()


def page(image: bytes, *, marked: bool = True) -> bytes:
    head = HTML_GENERATOR if marked else ""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">{head}\n<title>cadence report: run'
            f'</title></head><body><img src="data:image/png;base64,{base64.b64encode(image).decode()}"></body></html>\n'
            ).encode()


def with_text_chunk(data: bytes, key: bytes, value: bytes) -> bytes:
    """``data`` (a PNG) with one more tEXt chunk after its header."""
    body = key + b"\0" + value
    chunk = struct.pack(">I", len(body)) + b"tEXt" + body + struct.pack(">I", zlib.crc32(b"tEXt" + body))
    return data[:33] + chunk + data[33:]


def test_a_users_page_png_directory_or_link_is_refused_and_nothing_written(tmp_path: Path) -> None:
    html, image = tmp_path / "r.html", tmp_path / "r.png"
    html.write_text("<html>my notes</html>")
    with pytest.raises(ConfigError) as caught:
        write_report(str(html), page(png(PNG_METADATA)), str(image), png(PNG_METADATA), "--out")
    assert str(caught.value) == (f"--out {html}: exists and is not a report cadence wrote; choose another path or "
                                 "remove it (nothing was written)")
    assert caught.value.exit_code == 2
    assert html.read_text() == "<html>my notes</html>" and not image.exists()
    html.unlink()
    image.write_bytes(png())  # a PNG of the user's (matplotlib's, unmarked, and no cadence page embeds it)
    mine = image.read_bytes()
    with pytest.raises(ConfigError, match=rf"--out {html}: the PNG beside it, {image}, exists and is not one cadence "
                                          "wrote"):
        check_report_targets(str(html), str(image), "--out")
    assert image.read_bytes() == mine and not html.exists()
    image.unlink()
    html.mkdir()
    with pytest.raises(ConfigError, match=f"--out {html}: is a directory;"):
        check_report_targets(str(html), str(image), "--out")
    html.rmdir()
    os.symlink(tmp_path / "elsewhere.html", html)
    with pytest.raises(ConfigError, match=f"--out {html}: is a symbolic link;"):
        check_report_targets(str(html), str(image), "--out")
    assert os.listdir(tmp_path) == ["r.html"]


def test_a_report_cadence_wrote_is_replaced_marked_or_from_before_the_mark(tmp_path: Path) -> None:
    html, image = tmp_path / "out" / "r.html", tmp_path / "out" / "r.png"
    first = png(PNG_METADATA)
    assert write_report(str(html), page(first), str(image), first, "--out") == (str(html), str(image))
    assert image.read_bytes() == first and HTML_GENERATOR in html.read_text()
    second = png({**PNG_METADATA, "Title": "second"})
    write_report(str(html), page(second), str(image), second, "--out")
    assert image.read_bytes() == second

    old_png = png()  # as cadence wrote them before the mark: matplotlib's PNG, embedded by the page
    html.write_bytes(page(old_png, marked=False))
    image.write_bytes(old_png)
    write_report(str(html), page(first), str(image), first, "--out")
    assert image.read_bytes() == first

    html.write_bytes(page(old_png, marked=False))
    image.write_bytes(with_text_chunk(old_png, b"Comment", b"edited"))  # not the PNG the page embeds
    with pytest.raises(ConfigError, match="the PNG beside it"):
        check_report_targets(str(html), str(image), "--out")
    assert sorted(os.listdir(tmp_path / "out")) == ["r.html", "r.png"]  # no temp file left
