"""The files ``transformers`` reads beside a ``tokenizer.json``, and the special token ids of a model.

``tokenizer_config.json`` names the special tokens (``bos_token``, ``eos_token``, ``pad_token``...)
and may hold the ``chat_template`` and ``model_max_length``; ``chat_template.jinja`` holds a template
in its own file. A model directory's ``config.json`` and ``generation_config.json`` give
``bos_token_id`` / ``eos_token_id`` (an int or a list: generation stops at any of them) /
``pad_token_id``. Tokenizers trained by shardlm have no config of their own: theirs is
:func:`synthesized_config`, whose end of sequence is the token that ends each document of the
training data (:data:`~shardlm.data.tokenizer.EOD`).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from dataclasses import dataclass, field
from typing import Any

from shardlm.data.tokenizer import Tokenizer, load_tokenizer, special_token_ids
from shardlm.errors import DataError
from shardlm.json_file import read_json

__all__ = ["SPECIAL_TOKEN_KEYS", "TOKENIZER_FILES", "TokenizerConfig", "eos_ids_of", "generation_config",
           "json_line", "model_special_ids", "read_tokenizer_config", "stage_tokenizer", "synthesized_config",
           "token_text", "write_tokenizer_files"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
"""The tokenizer's files, copied wherever the tokenizer goes (data directory, checkpoint, model directory)."""

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")
"""The special tokens of a ``tokenizer_config.json`` that ``transformers`` passes to a chat template."""


def token_text(value: Any) -> str | None:
    """The text of a special token as ``tokenizer_config.json`` stores it: a string or ``{"content":
    str, ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


@dataclass
class TokenizerConfig:
    """What ``transformers`` reads beside a ``tokenizer.json``.

    Attributes:
        tokenizer_path: the ``tokenizer.json``.
        config: the ``tokenizer_config.json`` dict (:func:`synthesized_config` when there is none).
        config_path: that file, or None.
        chat_template: the template text, or None when the tokenizer has none.
        template_source: the file the template came from (for error messages), or None.
    """

    tokenizer_path: pathlib.Path
    config: dict[str, Any] = field(default_factory=dict)
    config_path: pathlib.Path | None = None
    chat_template: str | None = None
    template_source: pathlib.Path | None = None

    @property
    def special_tokens(self) -> dict[str, str]:
        """``{"bos_token": text, "eos_token": text, ...}`` for the special tokens the config sets."""
        out = {}
        for key in SPECIAL_TOKEN_KEYS:
            text = token_text(self.config.get(key))
            if text is not None:
                out[key] = text
        return out


def read_tokenizer_config(
    tokenizer_path: str | pathlib.Path, tokenizer: Tokenizer | None = None
) -> TokenizerConfig:
    """Read ``tokenizer_config.json`` and ``chat_template.jinja`` beside ``tokenizer_path`` (both optional).

    Without a ``tokenizer_config.json`` the config is :func:`synthesized_config` (``config_path`` None), made
    from ``tokenizer`` when given (``tokenizer_path`` already loaded), else from the file.

    A ``chat_template`` given as a list of ``{"name", "template"}`` (several named templates) yields
    the one named ``default``.

    Raises:
        DataError: naming the file: ``tokenizer_config.json`` is not a JSON object, or its
            ``chat_template`` is neither a string nor a list with a ``default`` entry.
    """
    tok = pathlib.Path(tokenizer_path).expanduser()
    out = TokenizerConfig(tokenizer_path=tok)
    path = tok.parent / "tokenizer_config.json"
    if not path.is_file():
        out.config = synthesized_config(tokenizer if tokenizer is not None else load_tokenizer(str(tok)))
    else:
        config = read_json(path, DataError)
        out.config, out.config_path = config, path
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
            if not isinstance(template, str):
                raise DataError(f"{path}: 'chat_template' is a list without a template named 'default'")
        if template is not None and not isinstance(template, str):
            raise DataError(f"{path}: 'chat_template' must be a string")
        if template is not None:
            out.chat_template, out.template_source = template, path
    jinja = tok.parent / "chat_template.jinja"
    if jinja.is_file():
        out.chat_template, out.template_source = jinja.read_text(encoding="utf-8"), jinja
    return out


def synthesized_config(tok: Any) -> dict[str, Any]:
    """A ``tokenizer_config.json`` dict for a tokenizer that has none (``tok``: a ``tokenizers.Tokenizer``).

    ``bos_token`` / ``eos_token`` are found by name (:func:`~shardlm.data.tokenizer.special_token_ids`);
    the end of sequence is the end-of-document token when the tokenizer has one (the token shardlm
    puts after every document of the training data), and it also pads.
    """
    ids = special_token_ids(tok)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "clean_up_tokenization_spaces": False}
    if ids["bos"] is not None:
        config["bos_token"] = tok.id_to_token(ids["bos"])
    eos = ids["eod"] if ids["eod"] is not None else ids["eos"]
    if eos is not None:
        config["eos_token"] = config["pad_token"] = tok.id_to_token(eos)
    return config


def json_line(path: pathlib.Path, key: str) -> int:
    """The 1-based line of ``"key":`` in a JSON file (1 when not found): for error messages."""
    try:
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if f'"{key}"' in line:
                return i
    except (OSError, UnicodeDecodeError):
        pass
    return 1


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _json(path: pathlib.Path) -> dict[str, Any]:
    """The JSON object in ``path``; DataError naming it otherwise."""
    return read_json(path, DataError)


def eos_ids_of(directory: str | pathlib.Path) -> dict[str, list[int]]:
    """``{"config.json": [...], "generation_config.json": [...]}``: the ``eos_token_id`` values (int or
    list, as a list) of the files present in ``directory``; a missing file or key gives no entry."""
    out = {}
    for name in ("config.json", "generation_config.json"):
        path = pathlib.Path(directory) / name
        if path.is_file():
            data = _json(path)
            if data.get("eos_token_id") is not None:
                out[name] = _ids(data["eos_token_id"])
    return out


@dataclass
class OpenedTokenizer:
    """A tokenizer opened once (:func:`open_tokenizer`) and handed to every step of a preparation, so that
    none reads its files again: the ``tokenizers`` object, its files (``tokenizer_config.json``, chat
    template) and the special ids a model trained with it writes (:func:`model_special_ids`)."""

    tokenizer: Tokenizer
    """The ``tokenizer.json``, loaded."""
    files: TokenizerConfig
    """What ``transformers`` reads beside it (:func:`read_tokenizer_config`)."""
    model_special_ids: dict[str, Any]
    """``{"bos", "eos", "pad"}`` of the model whose tokenizer it is (see :func:`model_special_ids`)."""

    @property
    def path(self) -> pathlib.Path:
        """The ``tokenizer.json`` (user directory expanded)."""
        return self.files.tokenizer_path


def open_tokenizer(tokenizer_path: str | pathlib.Path, tokenizer: Tokenizer | None = None) -> OpenedTokenizer:
    """Load ``tokenizer_path`` and read the files beside it, once.

    ``tokenizer``: the content of ``tokenizer_path`` already in memory (a tokenizer just trained, saved
    there or about to be): it is not parsed again.

    Raises:
        DataError: the file is missing or not a tokenizer, or its config files are unreadable (naming
        the file).
    """
    tok = tokenizer if tokenizer is not None else load_tokenizer(str(tokenizer_path))
    files = read_tokenizer_config(tokenizer_path, tok)
    return OpenedTokenizer(tok, files, _model_special_ids(files, tok))


def model_special_ids(tokenizer_path: str | pathlib.Path | OpenedTokenizer) -> dict[str, Any]:
    """The special token ids of the model whose tokenizer is ``tokenizer_path`` (or an opened one's,
    read once).

    Returns ``{"bos": int | None, "eos": [int, ...], "pad": int | None}``: ``eos`` lists the
    ``eos_token_id`` of ``config.json``, then of ``generation_config.json`` (when the tokenizer lies
    in a model directory), then the tokenizer's ``eos_token``, each id once; ``bos`` is
    ``config.json``'s ``bos_token_id`` or the tokenizer's ``bos_token``; ``pad`` the tokenizer's
    ``pad_token`` or ``generation_config.json``'s ``pad_token_id``.

    Raises:
        DataError: unreadable tokenizer files (see :func:`read_tokenizer_config`).
    """
    if isinstance(tokenizer_path, OpenedTokenizer):
        return dict(tokenizer_path.model_special_ids)
    files = read_tokenizer_config(tokenizer_path)
    return _model_special_ids(files, load_tokenizer(str(files.tokenizer_path)))


def _model_special_ids(files: TokenizerConfig, tok: Tokenizer) -> dict[str, Any]:
    """:func:`model_special_ids` of a tokenizer read and loaded."""

    def token_id(key: str) -> int | None:
        text = token_text(files.config.get(key))
        return None if text is None else tok.token_to_id(text)

    directory = files.tokenizer_path.parent
    eos: list[int] = []
    for ids in eos_ids_of(directory).values():
        eos += [i for i in ids if i not in eos]
    if token_id("eos_token") is not None and token_id("eos_token") not in eos:
        eos.append(token_id("eos_token"))
    config = _json(directory / "config.json") if (directory / "config.json").is_file() else {}
    gen = (
        _json(directory / "generation_config.json")
        if (directory / "generation_config.json").is_file()
        else {}
    )
    bos = config.get("bos_token_id") if isinstance(config.get("bos_token_id"), int) else token_id("bos_token")
    pad = token_id("pad_token")
    if pad is None and isinstance(gen.get("pad_token_id"), int):
        pad = gen["pad_token_id"]
    return {"bos": bos, "eos": eos, "pad": pad}


def generation_config(special: dict[str, Any]) -> dict[str, Any]:
    """The ``generation_config.json`` dict for ``special`` (see :func:`model_special_ids`): bos, eos,
    pad ids."""
    eos = list(special.get("eos") or [])
    out: dict[str, Any] = {"bos_token_id": special.get("bos"),
                           "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    if special.get("pad") is not None:
        out["pad_token_id"] = special["pad"]
    return out


def write_tokenizer_files(tokenizer_path: str | pathlib.Path | OpenedTokenizer, out_dir: str | pathlib.Path,
                          chat_template: str | None = None, model_max_length: int | None = None,
                          copy_tokenizer: bool = True) -> None:
    """Copy a tokenizer into ``out_dir``: ``tokenizer.json``, ``tokenizer_config.json`` (the source's, or
    :func:`synthesized_config`), ``chat_template.jinja`` and ``special_tokens_map.json`` when present.

    ``chat_template`` is added to the config when the tokenizer has none; ``model_max_length`` is
    set when the config lacks it or holds ``transformers``' "no limit" sentinel (>= 1e29). With
    ``copy_tokenizer`` False, ``tokenizer.json`` itself is left to the caller.

    Raises:
        DataError: unreadable tokenizer files.
    """
    files = (
        tokenizer_path.files
        if isinstance(tokenizer_path, OpenedTokenizer)
        else read_tokenizer_config(tokenizer_path)
    )
    out = pathlib.Path(out_dir)
    config = dict(files.config)
    if chat_template is not None and files.chat_template is None:
        config["chat_template"] = chat_template
    if model_max_length is not None and not (isinstance(config.get("model_max_length"), (int, float))
                                             and config["model_max_length"] < 1e29):
        config["model_max_length"] = int(model_max_length)
    if copy_tokenizer and files.tokenizer_path.resolve() != (out / "tokenizer.json").resolve():
        shutil.copyfile(files.tokenizer_path, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    for name in TOKENIZER_FILES[2:]:
        src = files.tokenizer_path.parent / name
        if src.is_file() and src.resolve() != (out / name).resolve():
            shutil.copyfile(src, out / name)


def stage_tokenizer(opened: OpenedTokenizer, stage: str | pathlib.Path) -> None:
    """Write an opened tokenizer into a preparation's staging directory ``stage``, as every prepared
    directory holds it: its config files first (:func:`write_tokenizer_files`), then ``tokenizer.json``,
    atomically, whose presence marks the staged tokenizer complete (a restart keeps it). ``tokenizer.json``
    is the file ``opened`` was read from, copied byte for byte, or, for a tokenizer trained in memory whose
    path is the staged file itself, that object saved.

    One rule for a corpus and a mixture (its top level and each source): the given tokenizer's
    ``tokenizer_config.json`` (special tokens, chat template) goes with it, never a made-up one.

    Raises:
        OSError: ``stage`` cannot be written.
    """
    staged = pathlib.Path(stage) / "tokenizer.json"
    tmp = staged.with_name("tokenizer.json.tmp")
    write_tokenizer_files(opened, stage, copy_tokenizer=False)
    if opened.path.is_file() and opened.path.resolve() != staged.resolve():
        shutil.copyfile(opened.path, tmp)
    else:
        opened.tokenizer.save(str(tmp))
    os.replace(tmp, staged)
