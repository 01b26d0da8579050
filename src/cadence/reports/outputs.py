"""Where a report is written (``cadence report`` of a run or of a sweep): the page and the PNG beside
it, which replace only a report cadence wrote.

A report carries its generator: the page :data:`HTML_GENERATOR` (``<meta name="generator"
content="cadence report">``) in its head, the PNG a ``Software: cadence report`` text chunk
(:data:`PNG_METADATA`, for matplotlib's ``savefig(metadata=...)``). A path is written only when
nothing is there, or a report cadence wrote: by that mark or, for one written before the mark, a
page whose title is cadence's (``cadence report: ...``, ``cadence sweep report: ...``) and a PNG
that such a page beside it embeds byte for byte. Anything else -- a file of the user's, a
directory, a symbolic link -- is refused with one :class:`~cadence.errors.ConfigError` (exit 2),
checked before the report is built and again just before each write; nothing is then written.
"""

from __future__ import annotations

import base64
import posixpath
import struct

from cadence import layout
from cadence.errors import ConfigError
from cadence.storage import Storage, unwritable_reason

__all__ = ["GENERATOR", "HTML_GENERATOR", "PNG_METADATA", "check_report_targets", "report_paths", "write_report"]

GENERATOR = "cadence report"
HTML_GENERATOR = f'<meta name="generator" content="{GENERATOR}">'
"""In the head of every page cadence writes: the mark that it may be replaced."""
PNG_METADATA = {"Software": GENERATOR}
"""The PNG's text chunk that marks it as cadence's (matplotlib's ``savefig(metadata=...)``)."""
REPORT_HTML = "report.html"
_HEAD_BYTES = 4096  # where a page's mark or title is looked for
_PNG_HEAD_BYTES = 1 << 16  # where a PNG's text chunks are looked for (before its image data)
_LEGACY_TITLES = (b"<title>cadence report: ", b"<title>cadence sweep report: ")
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def report_paths(model_dir: str, out: str | None) -> tuple[str, str]:
    """The page's and the PNG's paths: ``out`` (default ``<model_dir>/report.html``) and the same
    stem with ``.png``. ConfigError for an ``out`` ending in ``.png`` or under ``checkpoints/``."""
    html_path = layout.join(model_dir, REPORT_HTML) if out is None else out
    stem, ext = posixpath.splitext(html_path)
    if ext.lower() == ".png":
        raise ConfigError(f"--out: the HTML page's path, not a .png (the PNG goes next to it): {out}")
    png_path = stem + ".png"
    checkpoints = Storage(layout.checkpoints_dir(model_dir))
    for path in (html_path, png_path):
        target = Storage(path)
        if target.fs is checkpoints.fs and (target.root + "/").startswith(checkpoints.root + "/"):
            raise ConfigError(f"--out: the report is never written into checkpoints/: {path}")
    return html_path, png_path


def _png_software(head: bytes) -> str | None:
    """The ``Software`` text chunk of the PNG that starts with ``head`` (before its image data), or None."""
    if not head.startswith(_PNG_SIGNATURE):
        return None
    at = len(_PNG_SIGNATURE)
    while at + 8 <= len(head):
        (length,), kind = struct.unpack(">I", head[at:at + 4]), head[at + 4:at + 8]
        if kind in (b"IDAT", b"IEND"):
            return None
        if kind == b"tEXt":
            key, _, value = head[at + 8:at + 8 + length].partition(b"\0")
            if key == b"Software":
                return value.decode("latin-1")
        at += 12 + length
    return None


def _is_cadence_page(storage: Storage, path: str) -> bool:
    head = bytes(storage.read_view(path, _HEAD_BYTES))
    return HTML_GENERATOR.encode() in head or any(title in head for title in _LEGACY_TITLES)


def _is_cadence_png(storage: Storage, path: str, page: str) -> bool:
    """Marked as cadence's, or (written before the mark) embedded byte for byte by the cadence page ``page``."""
    if _png_software(bytes(storage.read_view(path, _PNG_HEAD_BYTES))) == GENERATOR:
        return True
    pages = Storage(page)
    if pages.entry_kind(pages.root) != "file" or not _is_cadence_page(pages, pages.root):
        return False
    data = storage.read_bytes(path)
    return data.startswith(_PNG_SIGNATURE) and base64.b64encode(data) in pages.read_bytes(pages.root)


def _refusal(path: str, page: str) -> str | None:
    """Why a report may not be written at ``path`` (the page, or its PNG beside ``page``), or None."""
    storage = Storage(path)
    kind = storage.entry_kind(storage.root)
    if kind is None:
        return unwritable_reason(path)  # a file on its path, a directory this process may not write
    if kind != "file":
        return {"link": "is a symbolic link", "dir": "is a directory"}.get(kind, "is not a regular file")
    if path == page:
        return None if _is_cadence_page(storage, storage.root) else "exists and is not a report cadence wrote"
    return None if _is_cadence_png(storage, storage.root, page) else "exists and is not one cadence wrote"


def check_report_targets(html_path: str, png_path: str, label: str) -> None:
    """ConfigError, one line naming ``label`` (``--out``) and the page's path, unless both the page
    and the PNG may be written (see the module docstring). Reads only."""
    for path in (html_path, png_path):
        why = _refusal(path, html_path)
        if why is not None:
            if path != html_path:
                why = f"the PNG beside it, {Storage(path).url(Storage(path).root)}, {why}"
            raise ConfigError(f"{label} {html_path}: {why}; choose another path or remove it (nothing was written)")


def write_report(html_path: str, page: bytes, png_path: str, png: bytes, label: str) -> tuple[str, str]:
    """Write the PNG, then the page (an older PNG is recognised by the page beside it), each checked
    again just before (:func:`check_report_targets`); a new file is created exclusively, so one that
    appears meanwhile is never overwritten unless cadence's, and a report cadence wrote is replaced
    atomically (on local disks). Returns the page's and the PNG's URLs."""
    urls = []
    for path, data in ((png_path, png), (html_path, page)):
        storage = Storage(path)
        check_report_targets(html_path, png_path, label)
        storage.makedirs(posixpath.dirname(storage.root) or "/")
        created = storage.entry_kind(storage.root) is None and storage.create_exclusive(storage.root, data)
        if not created:
            check_report_targets(html_path, png_path, label)  # it may have appeared since
            storage.write_atomic(storage.root, data)
        urls.append(storage.url(storage.root))
    return urls[1], urls[0]
