"""Helpers shared by the config classes and the engine arguments.

Mirrors vllm/config/utils.py (chapter 01).

Why it exists: each config field is written once, with its default and a docstring right
under it. `EngineArgs` takes its defaults from those fields (`get_field`, which also records
which config and field each argument sets), and the CLI takes its help text from those
docstrings (`get_attr_docs`), so neither is written twice.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
from dataclasses import MISSING, Field, field
from typing import Any


# The keys of an EngineArgs field's metadata: the config class it sets, and that class's field.
CONFIG = "config"
CONFIG_FIELD = "config_field"


def get_field(cls: type, name: str) -> Field:
    """A fresh `field(...)` with the default (or default factory) of `cls.name`, for EngineArgs.

    Its metadata names `cls` and `name`, so that EngineArgs can build the config and group
    the CLI flag from the field alone (vLLM's carries the default only).
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        raise ValueError(f"{cls.__name__} has no field {name!r}.")
    metadata = {CONFIG: cls, CONFIG_FIELD: name}
    if fields[name].default_factory is not MISSING:
        return field(default_factory=fields[name].default_factory, metadata=metadata)
    if fields[name].default is not MISSING:
        return field(default=fields[name].default, metadata=metadata)
    raise ValueError(f"{cls.__name__}.{name} has no default for EngineArgs to take.")


def get_attr_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written right under it in the class body (first paragraph).

    block_size: int = 16
    \"\"\"Tokens per KV cache block.\"\"\"      -> {"block_size": "Tokens per KV cache block."}
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # the class's statements
    docs: dict[str, str] = {}
    for statement, following in zip(body, body[1:]):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = " ".join(
                inspect.cleandoc(following.value.value).split("\n\n")[0].split()
            )
    return docs


def check_positive_int(name: str, value: Any) -> None:
    """Raise a ValueError naming `name` unless `value` is a positive int (not a bool)."""
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def config_from_dict(cls: type, name: str, config: dict[str, Any] | str) -> Any:
    """`cls(**config)` from `LLM(name={...})` or the CLI's JSON string, with a ValueError naming
    `name` for bad JSON, a non-dict or an unknown key."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{name} must be a dict, got {config!r}.")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"unknown {name} key(s) {unknown}; nano_v1 accepts {sorted(known)}.")
    return cls(**config)
