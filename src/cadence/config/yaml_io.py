"""The YAML of experiment configs: a YAML 1.2-style safe dialect (``1e-3`` is a number, only
``true`` / ``false`` are booleans), parsing with the line of every key and duplicate-key
detection, dumping that reads back equal, and reading a config file's text (local or fsspec)."""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from typing import Any

import yaml

from cadence.errors import ConfigError
from cadence.storage import Storage

__all__ = ["Loc", "YamlDumper", "YamlLoader", "dump_yaml", "load_value", "parse_yaml", "plain_data", "read_text"]

Loc = tuple[str, ...]
"""A key path in a config: ``("trainer", "train_steps")``; list items by their index as a string."""

_YAML_LINE_BREAKS = "\x85\u2028\u2029"


class YamlLoader(yaml.SafeLoader):
    """Safe YAML loader (no custom tags) with YAML 1.2's scalars: ``1e-3`` is a float, and only
    ``true``/``false`` are booleans (``on``, ``off``, ``yes``, ``no`` are strings)."""


class YamlDumper(yaml.SafeDumper):
    """Safe YAML dumper: quotes strings like ``"1e-3"``, which :class:`YamlLoader` reads as floats."""


# YAML 1.2 booleans: only true/false. YAML 1.1 also reads on/off/yes/no/y/n as booleans, which
# turns the key `on:` (export.on) into True and `country: no` into False.
YamlLoader.yaml_implicit_resolvers = {
    first: [r for r in resolvers if r[0] != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)

for _cls in (YamlLoader, YamlDumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )


MAX_DEPTH = 50
"""How deeply a config's values may nest (a deeper one is refused, not a RecursionError)."""
MAX_VALUES = 100_000
"""How many values a config may hold once its aliases are expanded (a YAML alias bomb is refused)."""


def parse_yaml(text: str, source: str) -> tuple[Any, dict[Loc, int]]:
    """The document and the line of each mapping key (by key path).

    Raises:
      ConfigError: invalid YAML, or a character YAML does not allow (a NUL byte), naming the line
        and column; values nested deeper than :data:`MAX_DEPTH` (the line of the first level too
        many); aliases that refer to themselves or expand to more than :data:`MAX_VALUES` values;
        an integer too long for Python to read (more than 4300 digits), naming its key.
    """
    deep = _too_deep_at(text)
    if deep is not None:  # PyYAML's scanner is slow on deep flow collections: refuse first
        raise ConfigError(f"{source}: {_line_column(text, deep)}: values nested too deeply (at most {MAX_DEPTH} levels)")
    lines: dict[Loc, int] = {}
    loader = None
    try:
        loader = YamlLoader(text)
        node = loader.get_single_node()
        if node is not None:
            check_expansion(node, source)
            _index_keys(node, (), lines, source)
        data = loader.construct_document(node) if node is not None else None
    except yaml.reader.ReaderError as exc:
        char = chr(exc.character) if isinstance(exc.character, int) else exc.character
        key = _key_of_character(text, exc.position)
        raise ConfigError(f"{source}: {_line_column(text, exc.position)}: {key + ': ' if key else ''}invalid YAML: "
                          f"the character {char!r} is not allowed (a control character)") from None
    except yaml.YAMLError as exc:
        raise ConfigError(_format_yaml_error(exc, source, lines)) from None
    except RecursionError:  # the parser itself recurses once per level
        raise ConfigError(f"{source}: values nested too deeply (at most {MAX_DEPTH} levels)") from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, lines


def _line_column(text: str, position: int) -> str:
    """``line L, column C`` (from 1) of character ``position`` of ``text``."""
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    return f"line {line}, column {column}"


def _key_of_character(text: str, position: int) -> str | None:
    """The key whose value holds the character YAML refused at ``position``, read from the text with
    every such character blanked (None if that text is no valid YAML either)."""
    printable = "".join(c if yaml.reader.Reader.NON_PRINTABLE.match(c) is None else " " for c in text)
    lines: dict[Loc, int] = {}
    loader = YamlLoader(printable)
    try:
        node = loader.get_single_node()
        if node is not None:
            _index_keys(node, (), lines, "")
    except (yaml.YAMLError, ConfigError, RecursionError):
        return None
    finally:
        loader.dispose()
    return _key_at(lines, text.count("\n", 0, position) + 1)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """YAML's int, with Python's limit on the digits of an int read from text (4300: a longer one
    raises ``ValueError``) refused as invalid YAML at the value's line."""
    try:
        return yaml.SafeLoader.construct_yaml_int(loader, node)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"an integer of {len(node.value):,} characters is too long (at most 4300 digits)",
            node.start_mark) from None


YamlLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def check_expansion(root: yaml.Node, source: str) -> None:
    """Refuse a node graph that is cyclic (a self-referencing alias), nested deeper than
    :data:`MAX_DEPTH`, or that expands to more than :data:`MAX_VALUES` values: the checks run on
    the graph, in time linear in its size, before anything is expanded."""
    size: dict[int, int] = {}  # id(node) -> values once expanded
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        children = _children(node)
        if done:
            on_path.discard(id(node))
            size[id(node)] = 1 + sum(size[id(c)] for c in children)
            if size[id(node)] > MAX_VALUES:
                raise ConfigError(f"{source}: line {node.start_mark.line + 1}: the values expand to more than "
                                  f"{MAX_VALUES:,} (an alias bomb?)")
            continue
        if id(node) in on_path:
            raise ConfigError(f"{source}: line {node.start_mark.line + 1}: an alias refers to a value that "
                              "contains it (recursive aliases are not allowed)")
        if id(node) in size:
            continue
        if depth > MAX_DEPTH:
            raise ConfigError(f"{source}: line {node.start_mark.line + 1}: values nested too deeply "
                              f"(at most {MAX_DEPTH} levels)")
        on_path.add(id(node))
        stack.append((node, depth, True))
        stack.extend((child, depth + 1, False) for child in children)


def _too_deep_at(text: str) -> int | None:
    """Where (the offset of the ``[`` / ``{``) ``text`` first nests flow collections deeper than
    :data:`MAX_DEPTH`, outside quoted strings and comments; None if it never does."""
    depth = 0
    quote = ""
    escaped = comment = False
    for i, c in enumerate(text):
        if comment:
            comment = c != "\n"
        elif quote:
            if escaped:
                escaped = False
            elif c == "\\" and quote == '"':
                escaped = True
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c == "#":
            comment = True
        elif c in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return i
        elif c in "]}":
            depth = max(0, depth - 1)
    return None


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def load_value(text: str, source: str) -> Any:
    """One YAML value (a ``--set`` value), with :func:`parse_yaml`'s limits."""
    return parse_yaml(text, source)[0]


def _index_keys(
    node: yaml.Node, loc: Loc, lines: dict[Loc, int], source: str, seen: set[int] | None = None
) -> None:
    seen = set() if seen is None else seen
    if id(node) in seen:  # aliases can make the graph cyclic
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            if (
                not isinstance(key_node, yaml.ScalarNode)
                or key_node.tag == "tag:yaml.org,2002:merge"
            ):
                continue
            key, line = key_node.value, key_node.start_mark.line + 1
            if key in first_line:
                path = ".".join((*loc, key))
                raise ConfigError(
                    f"{source}: line {line}: duplicate key {path!r} "
                    f"(first set on line {first_line[key]})"
                )
            first_line[key] = line
            lines[loc + (key,)] = line
            _index_keys(value_node, loc + (key,), lines, source, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index_keys(item, (*loc, str(i)), lines, source, seen)


def _format_yaml_error(exc: yaml.YAMLError, source: str, lines: Mapping[Loc, int]) -> str:
    """One line: the source, the line and column, the key whose value it is (when the keys were
    read: :func:`_key_at`) and PyYAML's problem."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    key = _key_at(lines, mark.line + 1) if mark is not None else None
    detail = f"{problem} ({context})" if context else problem
    return f"{source}: {where}{key + ': ' if key else ''}invalid YAML: {detail}".replace("\n", " ")


def _key_at(lines: Mapping[Loc, int], line: int) -> str | None:
    """The dotted key path whose value is at ``line``: the last key on or before it."""
    before = [(n, loc) for loc, n in lines.items() if n <= line]
    return ".".join(max(before)[1]) if before else None


def dump_yaml(data: Mapping[str, Any]) -> str:
    """``data`` as YAML that :class:`YamlLoader` reads back equal."""
    text = yaml.dump(data, Dumper=YamlDumper, sort_keys=False, allow_unicode=True)
    if any(c in text for c in _YAML_LINE_BREAKS):  # PyYAML writes them raw, then reads them as breaks
        text = yaml.dump(data, Dumper=YamlDumper, sort_keys=False, allow_unicode=False)
    return text


def plain_data(value: Any, path: str) -> Any:
    """``value`` as plain YAML data (tuples become lists); ConfigError naming ``path`` (the value's
    place in the config) when it holds something YAML cannot represent."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, datetime.date)):
        return value
    if isinstance(value, Mapping):
        return {k: plain_data(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"{path}: {type(value).__name__} values cannot be written to a YAML config")


def read_text(path: str) -> str:
    """The UTF-8 text of a config file (local path or fsspec URL); ConfigError naming the file."""
    try:
        storage = Storage(path)
        data = storage.read_bytes(storage.root)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except Exception as exc:  # permissions, network, unknown protocol...
        raise ConfigError(f"{path}: cannot read the config file: {exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
