"""A griffe extension for the API reference: cadence's docstrings cross-reference in Sphinx roles.

``:class:`~cadence.x.Name``` becomes an optional mkdocs-autorefs link titled ``Name`` (the whole
path without ``~``): it links when the target is on a reference page and renders as plain code
otherwise, so a reference to an undocumented or private object never fails ``mkdocs build --strict``.
A name without a dot is looked up beside the object whose docstring cites it. Loaded by mkdocs.yml
(``extensions: [docs/_griffe/sphinx_roles.py]``); nothing in the package imports it.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?P<role>class|func|meth|attr|mod|exc|data|obj):`(?P<text>[^`]+)`")
_TITLED = re.compile(r"(?P<title>.*?)\s*<(?P<target>[^<>]+)>", re.DOTALL)
_CALLABLE_ROLES = {"func", "meth"}


def _replace(text: str, scope: str, module: str) -> str:
    def one(match: re.Match[str]) -> str:
        text = " ".join(match["text"].split())
        if titled := _TITLED.fullmatch(text):  # `Title <target>`
            title, target = titled["title"], titled["target"].lstrip("~.")
        else:
            target = text.lstrip("~.")
            title = target.rsplit(".", 1)[-1] if text.startswith("~") else target
        if match["role"] in _CALLABLE_ROLES and not title.endswith(")"):
            title += "()"
        if target.startswith("cadence"):
            identifier = target
        else:  # relative: a name beside the citing object, or a dotted path inside its module
            identifier = f"{scope if '.' not in target else module}.{target}"
        title = title.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        return f'<autoref identifier="{identifier}" optional><code>{title}</code></autoref>'

    return _ROLE.sub(one, text)


class SphinxRoles(griffe.Extension):
    """Rewrite the Sphinx roles of every docstring before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        scope = obj.path if obj.is_module or obj.is_class else obj.parent.path if obj.parent else obj.path
        obj.docstring.value = _replace(obj.docstring.value, scope, obj.module.path)
