"""Reading a :class:`~shardlm.config.sections.Config`: TOML files, a recorded config and dotted command-line
overrides, each value checked against its field's type; then ``model.init_from``'s shape and the checks.

Precedence is command line > TOML file > dataclass defaults, as in torchtitan. An unknown section or key, or a
value of the wrong type, raises :class:`ConfigError` naming the dotted key.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from shardlm.config.checks import validate
from shardlm.config.objectives import NOT_OFFERED
from shardlm.config.sections import KEYWORD_KEYS, Config
from shardlm.errors import ConfigError
from shardlm.model.config import ModelConfig
from shardlm.model.hf_backend import fill_model_config, read_hf_config
from shardlm.model.hf_config import read_model_dir_config


def _list_hint(key: str, value: Any, item: Any) -> str:
    """For a list given as one value on the command line, how to write it there (TOML's list, quoted; the
    value as the example's one item when the items are strings)."""
    if isinstance(value, (list, tuple)):
        return ""
    example = f'"{value}"' if item is str and isinstance(value, str) else "..."
    return f"; on the command line a list is written in TOML, quoted: --{key}='[{example}]'"


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check ``value`` against the annotation ``typ`` and convert it; raise ConfigError naming ``key``."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):  # e.g. ``bool | int``: the first arm that accepts the value
        for arm in typing.get_args(typ):
            try:
                return _coerce(key, value, arm)
            except ConfigError:
                continue
        names = " or ".join(" or ".join(map(repr, typing.get_args(a))) if typing.get_origin(a) is Literal
                            else getattr(a, "__name__", str(a)) for a in typing.get_args(typ))
        raise ConfigError(f"{key}: expected {names}, got {value!r}")
    if origin is Literal:
        if value not in typing.get_args(typ):
            why = NOT_OFFERED.get(key, {}).get(value) if isinstance(value, str) else None
            raise ConfigError(f"{key}: {value!r} is not one of {list(typing.get_args(typ))}"
                              + (f" ({why})" if why else ""))
        return value
    if origin is list and dataclasses.is_dataclass(typing.get_args(typ)[0]):
        item_type = typing.get_args(typ)[0]
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ConfigError(f"{key}: expected a list of tables ([[{key}]]), got {value!r}")
        items = []
        for i, table in enumerate(value):
            item = item_type()
            for k, v in table.items():
                _apply(item, f"{key}[{i}]", k, v)
            items.append(item)
        return items
    if origin is tuple and typing.get_args(typ)[1:] == (Ellipsis,):  # e.g. ``tuple[str, ...]``: any length
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}"
                              f"{_list_hint(key, value, typing.get_args(typ)[0])}")
        return tuple(_coerce(f"{key}[{i}]", v, typing.get_args(typ)[0]) for i, v in enumerate(value))
    if origin is tuple:
        args = typing.get_args(typ)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}"
                              f"{_list_hint(key, value, None)}")
        return tuple(_coerce(f"{key}[{i}]", v, t) for i, (v, t) in enumerate(zip(value, args)))
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported field type {typ!r}")  # pragma: no cover - a bug in this file


def _parse_cli_value(text: str) -> Any:
    """Read a command-line value as a TOML value, falling back to a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


# public: what an override's value means (shardlm.cli.train reads --run.dir)
parse_cli_value = _parse_cli_value


def _apply(section_obj: Any, section: str, key: str, value: Any) -> None:
    hints = typing.get_type_hints(type(section_obj))
    attrs = {f.name for f in dataclasses.fields(section_obj)}
    attr = KEYWORD_KEYS.get(key, key)
    if attr not in attrs or attr in KEYWORD_KEYS.values() and key == attr:  # ``async_`` is spelt ``async``
        keys = {next((k for k, a in KEYWORD_KEYS.items() if a == name), name) for name in attrs}
        raise ConfigError(f"unknown config key '{section}.{key}' (known: {', '.join(sorted(keys))})")
    setattr(section_obj, attr, _coerce(f"{section}.{key}", value, hints[attr]))


def load_config(path: str | list[str] | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None, base_name: str = "the recorded config") -> Config:
    """Build a :class:`Config` from optional TOML files and ``--section.key=value`` overrides.

    Args:
        base: sections applied first, as ``Config.to_dict()`` writes them (a run directory's ``config.json``,
            for a resume from the run directory); ``base_name`` names it in errors.
        path: TOML file with sections named like the :class:`Config` fields, a list of such files applied in
            order (a later file's keys replace an earlier one's; e.g. a config, then the settings
            ``shardlm tune`` wrote), or None for defaults. ``run.name`` defaults to the first file's stem.
        overrides: command-line items such as ``--train.steps=50`` (values are parsed as TOML
            values, so ``true``, ``3e-4`` and ``[0.9, 0.95]`` work; bare words are strings).

    Raises:
        ConfigError: missing or unparsable file, unknown section or key, or a value of the wrong type.
    """
    cfg = Config()
    sections = {f.name for f in dataclasses.fields(cfg)}
    paths = [] if path is None else [path] if isinstance(path, str) else list(path)
    for section, table in (base or {}).items():
        if section not in sections or not isinstance(table, dict):
            raise ConfigError(f"unknown config section '{section}' in {base_name}")
        for key, value in table.items():
            _apply(getattr(cfg, section), section, key, value)
    for file in paths:
        p = Path(file)
        if not p.is_file():
            raise ConfigError(f"config file not found: {file}")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{file}: invalid TOML: {e}") from None
        for section, table in data.items():
            if section not in sections:
                raise ConfigError(f"unknown config section '{section}' in {file} (known: "
                                  f"{', '.join(sorted(sections))})")
            if not isinstance(table, dict):
                raise ConfigError(f"'{section}' in {file} must be a [section] table")
            for key, value in table.items():
                _apply(getattr(cfg, section), section, key, value)
    if paths and not cfg.run.name:
        cfg.run.name = Path(paths[0]).stem
    for item in overrides or []:
        if not item.startswith("--") or "=" not in item:
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        dotted, text = item[2:].split("=", 1)
        if dotted.count(".") != 1:
            raise ConfigError(f"override {item!r} must name one section and one key, e.g. --train.steps=50")
        section, key = dotted.split(".")
        if section not in sections:
            raise ConfigError(f"unknown config section '{section}' in override {item!r}")
        _apply(getattr(cfg, section), section, key, _parse_cli_value(text))
    if not cfg.run.name:
        cfg.run.name = "default"
    if cfg.model.init_from:
        apply_init_from(cfg)
    validate(cfg)
    return cfg


def apply_init_from(cfg: Config) -> None:
    """Make ``cfg.model`` the shape of ``cfg.model.init_from``'s ``config.json`` (in place).

    Every shape field is replaced (``init_std``, ``init_from`` and the attention settings are kept): the
    pretrained weights decide the model. ``data.tokenizer`` defaults to the directory's ``tokenizer.json``
    when empty.

    Raises:
        ModelDirError: the directory or its ``config.json`` is missing or invalid, or not a Llama.
    """
    if cfg.model.backend == "transformers":  # transformers' config of any architecture
        fill_model_config(cfg.model, read_hf_config(cfg.model.init_from))
        _default_tokenizer(cfg)
        return
    src = read_model_dir_config(cfg.model.init_from)
    for f in dataclasses.fields(ModelConfig):
        if f.name not in ("init_std", "init_from", "attention", "attention_backend", "backend"):
            setattr(cfg.model, f.name, getattr(src, f.name))
    _default_tokenizer(cfg)


def _default_tokenizer(cfg: Config) -> None:
    """``data.tokenizer``: ``model.init_from``'s ``tokenizer.json`` when empty and the file exists."""
    tokenizer = Path(cfg.model.init_from) / "tokenizer.json"
    if not cfg.data.tokenizer and tokenizer.is_file():
        cfg.data.tokenizer = str(tokenizer)
