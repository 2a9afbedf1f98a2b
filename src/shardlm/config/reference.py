"""The configuration reference: every section and key of :class:`~shardlm.config.sections.Config` with its
type, default and meaning, read from the dataclasses' field docstrings (the string literal written under each
field), as Markdown (``docs/reference/config.md``, written by ``python -m shardlm.cli.reference``).

:func:`config_keys` is the set of dotted keys the loader accepts, which the documentation's checks compare
every ``--section.key`` of README.md and docs/ against.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import textwrap
import types
import typing
from typing import Any, Literal

from shardlm.config.sections import KEYWORD_KEYS, Config, DataSource


def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring} of the dataclass ``cls``: the string literal that directly follows each
    annotated field in the class body (fields without one are left out), dedented, lines joined by spaces.

    Raises:
        TypeError: ``cls`` is not a class whose source Python can find (``inspect.getsource``).
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and \
                isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def toml_key(attr: str) -> str:
    """The TOML / command-line key of a field (``async_`` -> ``async``, see ``KEYWORD_KEYS``)."""
    return next((key for key, name in KEYWORD_KEYS.items() if name == attr), attr)


def sections() -> dict[str, type]:
    """{TOML section name: its dataclass}, in the order of :class:`Config`'s fields."""
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def config_keys() -> set[str]:
    """Every dotted key a config accepts: ``section.key`` for each field of each section (TOML spelling,
    ``checkpoint.async``), and ``data.sources.path`` etc. for the keys of a ``[[data.sources]]`` table."""
    keys = {f"{name}.{toml_key(f.name)}" for name, cls in sections().items() for f in dataclasses.fields(cls)}
    return keys | {f"data.sources.{f.name}" for f in dataclasses.fields(DataSource)}


def type_name(typ: Any) -> str:
    """A field's type as the reference shows it: ``int``, ``bool or int``, ``"a" or "b"`` (a choice of
    strings), ``[float, float]`` (a list of that length), ``[str, ...]``, ``[[tables]]``. No ``|``: the
    text goes into a Markdown table."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is tuple:
        return "[" + (f"{type_name(args[0])}, ..." if args[1:] == (Ellipsis,) else
                      ", ".join(type_name(a) for a in args)) + "]"
    if origin is list:
        return "[[tables]]" if dataclasses.is_dataclass(args[0]) else f"[{type_name(args[0])}, ...]"
    return getattr(typ, "__name__", str(typ))


def toml_value(value: Any) -> str:
    """``value`` as TOML writes it: ``true``, ``"text"``, ``[0.9, 0.95]``, ``3e-05``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def default_of(f: dataclasses.Field) -> Any:
    """A field's default value (calling its ``default_factory``)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def markdown_text(doc: str) -> str:
    """A docstring's reStructuredText bits as Markdown: ````x```` -> ```x```, ``:func:`~a.b``` -> ```b```,
    ``:mod:`a.b``` -> ```a.b```; ``|`` escaped for a table cell."""
    doc = re.sub(r":\w+:`(~?)([\w.]+)`",
                 lambda m: f"`{m.group(2).split('.')[-1] if m.group(1) else m.group(2)}`", doc)
    return doc.replace("``", "`").replace("|", "\\|")


def _table(prefix: str, cls: type) -> list[str]:
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    rows = ["| Key | Type | Default | Meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        default = default_of(f)
        shown = "none" if isinstance(default, list) and not default else f"`{toml_value(default)}`"
        rows.append(f"| `{prefix}.{toml_key(f.name)}` | `{type_name(hints[f.name])}` | {shown} | "
                    f"{markdown_text(docs.get(f.name, ''))} |")
    return rows


INTRO = ("A run's configuration is a TOML file of the sections below (e.g. `configs/shakespeare-tiny.toml`); "
         "any key can be set on the command line as `--section.key=value` (the value read as TOML: `true`, "
         "`3e-4`, `[0.9, 0.95]`, bare words as strings). The command line wins over the file, the file over "
         "the defaults shown here. An unknown section or key, or a value of the wrong type, stops with one "
         "line naming the key.")


def _class_doc(cls: type) -> str:
    return markdown_text(" ".join(inspect.cleandoc(cls.__doc__ or "").split()))


def config_reference() -> str:
    """The configuration reference page (Markdown): one table per section, each key with its type, default
    and meaning (its field docstring), the ``[[data.sources]]`` table's keys after ``[data]``."""
    lines = ["<!-- generated by `python -m shardlm.cli.reference` from the config dataclasses' field "
             "docstrings: do not edit -->", "", "# Configuration reference", "", INTRO, ""]
    for name, cls in sections().items():
        lines += [f"## [{name}]", "", _class_doc(cls), ""]
        lines += _table(name, cls) + [""]
        if cls is sections()["data"]:
            lines += ["### [[data.sources]]", "", _class_doc(DataSource), ""]
            lines += _table("data.sources", DataSource) + [""]
    return "\n".join(lines)
