"""``--config.a.b=value`` overrides of an experiment config (ml-collections' config_flags convention).

Each override names an existing field and is parsed to that field's type, so an
unknown key or a value of the wrong type is an error naming it before any work
starts.
"""
from __future__ import annotations

import ast
from typing import Any, Sequence

import ml_collections

PREFIX = "--config."
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def split_args(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """(other args, [(dotted key, value text)]) from `--config.k=v` and `--config.k v` forms."""
    rest, found, i = [], [], 0
    argv = list(argv)
    while i < len(argv):
        a = argv[i]
        if a.startswith(PREFIX):
            key, eq, value = a[len(PREFIX):].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{a} has no value; write {a}=VALUE")
                value, i = argv[i + 1], i + 1
            if not key:
                raise ValueError(f"{a!r} names no field; write --config.SECTION.FIELD=VALUE")
            found.append((key, value))
        else:
            rest.append(a)
        i += 1
    return rest, found


def parse_value(key: str, text: str, current: Any) -> Any:
    """`text` as the type of `current` (the field's value in the config)."""
    def bad(expected: str) -> ValueError:
        return ValueError(f"--config.{key}={text!r}: expected {expected} (the field is "
                          f"{type(current).__name__}, now {current!r})")
    if isinstance(current, bool):
        if text.lower() in TRUE:
            return True
        if text.lower() in FALSE:
            return False
        raise bad("true or false")
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise bad("an integer") from None
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            raise bad("a number") from None
    if isinstance(current, str):
        return text
    if isinstance(current, (tuple, list, dict)) or current is None:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise bad(f"a Python literal {type(current).__name__}") from None
        if current is not None and not isinstance(value, type(current)):
            raise bad(f"a {type(current).__name__} literal")
        return value
    raise bad("a field that can be set from the command line")


def apply(cfg: ml_collections.ConfigDict, overrides: Sequence[tuple[str, str]]) -> ml_collections.ConfigDict:
    """`cfg` with each (dotted key, value text) set; a ValueError names an unknown key or a bad value."""
    for key, text in overrides:
        node, parts = cfg, key.split(".")
        for depth, part in enumerate(parts):
            where = ".".join(parts[:depth]) or "the config"
            if not isinstance(node, ml_collections.ConfigDict):
                raise ValueError(f"--config.{key}: {where} is a value, not a section")
            if part not in node:
                raise ValueError(f"--config.{key}: unknown key {part!r} in {where}; it has {sorted(node.keys())}")
            if depth == len(parts) - 1:
                if isinstance(node[part], ml_collections.ConfigDict):
                    raise ValueError(f"--config.{key} is a section; set one of its fields "
                                     f"{sorted(node[part].keys())}")
                node[part] = parse_value(key, text, node[part])
            else:
                node = node[part]
    return cfg
