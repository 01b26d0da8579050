"""The generated references (docs/config.md, docs/cli.md) are current and complete."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from cadence.cli import docgen
from cadence.cli.parser import build_parser
from cadence.config import ExperimentConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


@pytest.mark.parametrize("name", sorted(docgen.DOCS))
def test_committed_docs_are_current(name):
    path = DOCS / name
    assert path.is_file(), f"docs/{name} is missing: run `make docs`"
    assert path.read_text(encoding="utf-8") == docgen.DOCS[name](), f"docs/{name} is stale: run `make docs`"


@pytest.mark.parametrize("name", sorted(docgen.DOCS))
def test_pages_say_they_are_generated(name):
    first = (DOCS / name).read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("<!--") and "make docs" in first and "python -m cadence.cli.docgen" in first
    assert "Do not edit by hand" in first


# -- every field of every model is in its section -----------------------------------------------------


def _models_in(annotation: Any) -> list[tuple[str, type[BaseModel]]]:
    """Written independently of docgen: (suffix, model) for the models an annotation holds."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [("", annotation)]
    origin = typing.get_origin(annotation)
    found = []
    for arg in typing.get_args(annotation):
        for suffix, model in _models_in(arg):
            if origin in (list, tuple, set, frozenset):
                suffix = "[]" + suffix
            elif origin is dict:
                suffix = ".*" + suffix
            found.append((suffix, model))
    return found


def _expected_sections(model: type[BaseModel], path: str = "") -> dict[str, list[str]]:
    out = {path or "top level": [f.alias or n for n, f in model.model_fields.items()]}
    for name, field in model.model_fields.items():
        for suffix, child in _models_in(field.annotation):
            key = f"{field.alias or name}{suffix}"
            out.update(_expected_sections(child, f"{path}.{key}" if path else key))
    return out


def _documented_sections(text: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:].strip(), [])
        elif current is not None and line.startswith("| `"):
            current.append(line.split("`")[1])
    return sections


def test_config_reference_documents_every_field_in_its_section():
    expected = _expected_sections(ExperimentConfig)
    documented = _documented_sections((DOCS / "config.md").read_text(encoding="utf-8"))
    assert {"top level", "task", "trainer", "trainer.best_checkpoint", "sidecar", "export"} <= set(expected)
    for section, keys in expected.items():
        assert section in documented, f"docs/config.md has no section {section!r}: run `make docs`"
        assert documented[section] == keys, f"docs/config.md, section {section!r}: run `make docs`"
    assert set(documented) == set(expected)
    assert "| `class` |" in (DOCS / "config.md").read_text(encoding="utf-8")  # the alias, not task_class


# -- rendering, on a toy model ------------------------------------------------------------------------


class _Hook(BaseModel):
    """A hook.

    Second paragraph, not shown.
    """

    hook_class: str = Field(alias="class", description="What to build.")
    params: dict[str, Any] = Field(default_factory=dict)


class _Inner(BaseModel):
    """Inner settings."""

    rate: float = Field(default=0.5, gt=0, le=1, description="A rate | a fraction.")


class _Toy(BaseModel):
    """The toy root."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(description="Required name.")
    steps: int | None = Field(default=10, ge=1, strict=True, description="Steps;\n  `null`: forever.")
    mode: Literal["every", "latest"] = "every"
    precision: Literal["32", "bf16"] = "32"
    flag: bool = False
    clip: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    tags: list[str] = Field(default_factory=lambda: ["a", "b"])
    inner: _Inner = Field(default_factory=_Inner, description="The inner section.")
    maybe: _Inner | None = None
    hooks: list[_Hook] = Field(default_factory=list, description="Hooks, in order.")
    named: dict[str, _Inner] = Field(default_factory=dict)


def _rows(text: str, section: str) -> dict[str, list[str]]:
    lines = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0].splitlines()
    rows = {}
    for line in lines:
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").replace("\\|", "\x00").split("|")]
            cells = [c.replace("\x00", "|") for c in cells]
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_sections_walk_nested_optional_list_and_mapping_models():
    assert [(s.path, s.model) for s in docgen.config_sections(_Toy)] == [
        ("", _Toy), ("inner", _Inner), ("maybe", _Inner), ("hooks[]", _Hook), ("named.*", _Inner),
    ]


def test_toy_model_renders_types_defaults_and_constraints():
    text = docgen.config_reference(_Toy)
    top = _rows(text, "top level")
    assert top["name"] == ["str", "required", "", "Required name."]
    assert top["steps"] == ["int | null", "`10`", ">= 1", "Steps; `null`: forever."]
    assert top["mode"] == ['"every" | "latest"', "`every`", "", ""]
    assert top["precision"] == ['"32" | "bf16"', "`'32'`", "", ""]  # quoted: YAML would read 32 as an int
    assert top["flag"] == ["bool", "`false`", "", ""]
    assert top["clip"] == ["float | null", "`null`", "> 0, finite", ""]
    assert top["tags"] == ["list of str", "`[a, b]`", "", ""]
    assert top["inner"] == ["section ([inner](#inner))", "`{}`", "", "The inner section."]
    assert top["maybe"][:2] == ["section ([maybe](#maybe)) | null", "`null`"]
    assert top["hooks"] == ["list of sections ([hooks[]](#hooks))", "`[]`", "", "Hooks, in order."]
    assert top["named"][0] == "mapping of str to section ([named.*](#named))"
    assert _rows(text, "named.*")["rate"] == _rows(text, "maybe")["rate"]
    assert _rows(text, "inner")["rate"] == ["float", "`0.5`", "> 0, <= 1", "A rate | a fraction."]
    hook = _rows(text, "hooks[]")
    assert list(hook) == ["class", "params"]  # the YAML key (alias), not the attribute name
    assert hook["params"] == ["mapping", "`{}`", "", ""]
    assert "A hook.\n" in text and "Second paragraph" not in text
    assert "A rate \\| a fraction." in text  # escaped in the table cell


def test_a_changed_model_changes_the_reference():
    class Wider(_Toy):
        extra: int = Field(default=3, description="New.")

    assert docgen.config_reference(Wider) != docgen.config_reference(_Toy)
    assert _rows(docgen.config_reference(Wider), "top level")["extra"] == ["int", "`3`", "", "New."]
    assert docgen.config_reference(_Toy) == docgen.config_reference(_Toy)


# -- CLI reference ------------------------------------------------------------------------------------


def test_cli_reference_has_every_subcommand_of_thebuild_parser():
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    names = [name for name, _, _ in docgen._subcommands(build_parser())]
    assert {"train", "evaluate", "launch", "export", "ls"} <= set(names)
    for name in names:
        assert f"\n## cadence {name}\n" in text
        assert f"usage: cadence {name} " in text


def test_cli_reference_picks_up_a_new_subcommand():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    new = sub.add_parser("frobnicate", help="frobnicate a model dir")
    new.add_argument("--level", type=int, default=1, help="how hard (default 1)")
    text = docgen.cli_reference(parser)
    assert "## cadence frobnicate\n\nFrobnicate a model dir.\n" in text
    assert "usage: cadence frobnicate [-h] [--level LEVEL]" in text
    assert "how hard (default 1)" in text


def test_generation_ignores_the_terminal_and_check_names_stale_pages(tmp_path):
    env = {**os.environ, "COLUMNS": "40"}
    code = ("import sys, cadence.cli.docgen as d; sys.exit(d.main(sys.argv[1:]) or "
            "('torch' in sys.modules and 'torch imported'))")
    docs = tmp_path / "docs"
    run = lambda *args: subprocess.run([sys.executable, "-c", code, "--docs-dir", str(docs), *args],
                                       env=env, capture_output=True, text=True, timeout=120, check=False)
    out = run()
    assert out.returncode == 0, out.stderr
    for name, render in docgen.DOCS.items():  # a 40-column terminal changes nothing
        assert (docs / name).read_text(encoding="utf-8") == render()
    assert run("--check").returncode == 0
    (docs / "cli.md").write_text("edited by hand\n", encoding="utf-8")
    out = run("--check")
    assert out.returncode == 1
    assert f"{docs / 'cli.md'} is stale: run `make docs`" in out.stderr
    assert "config.md" not in out.stderr
    assert (docs / "cli.md").read_text(encoding="utf-8") == "edited by hand\n"  # --check writes nothing
