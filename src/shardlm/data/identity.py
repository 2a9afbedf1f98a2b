"""What a prepared directory was made from (``meta.json``'s ``identity``), and how a config's data compares
with it.

An identity is a JSON-able dict:

* ``version``: :data:`IDENTITY_VERSION`;
* ``sources``: ``[{"name", "corpus", "inputs"}]``, one entry for a corpus (name ``""``), one per source of a
  mixture; ``inputs`` lists every input read, in reading order: a file as ``{"path", "size", "mtime_ns",
  "sample_sha256"}``, a ``datasets`` directory as ``{"path", "files": [...]}`` (its files, same form; the
  path carries ``:SPLIT`` when one was named), a cached ``hf:NAME[:SPLIT]`` as ``{"path", "fingerprint"}``;
* ``text_field``;
* ``tokenizer``: ``{"setting", "files"}`` where ``setting`` is ``data.tokenizer`` as given (``""``: trained,
  then also ``vocab_size`` and ``sample_bytes``) and ``files`` maps each tokenizer file (``tokenizer.json``,
  and beside it ``tokenizer_config.json``, ``chat_template.jinja``, ``special_tokens_map.json``) to its
  SHA-256: of the given files, or of the trained tokenizer's files as written;
* ``chat_template`` (instruction data): ``{"sha256", "source"}`` of the template the examples were
  rendered with;
* ``settings``: the other data settings that change the tokens, by config key (``data.format``,
  ``data.val_fraction``, ``data.piece_bytes``, the token dtype that ``model.vocab_size`` decides; a trained
  mixture tokenizer also the sources' weights).

Paths are absolute and normalised (``os.path.abspath``: another spelling of the same path is the same input).
A file is the same when its size, modification time and sample hash are (the sample: 16 blocks of 4 KiB
spread evenly over the file, the whole file when it is smaller; at most 64 KiB read per file, so a check
costs a ``stat`` and 16 reads per file whatever the corpus size). A tokenizer is the same when its files
have the same content, wherever they lie. ``train.seed`` (the trained tokenizer's sample) is recorded in
``meta.json`` but not compared: a seed sweep reuses its data.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Any

from shardlm.data.chat import DEFAULT_CHAT_TEMPLATE
from shardlm.data.readers import expand_corpus, hf_dataset
from shardlm.data.tokenizer_files import TOKENIZER_FILES, read_tokenizer_config

__all__ = ["IDENTITY_VERSION", "corpus_identity", "describe_corpus", "describe_instructions",
           "describe_mixture", "differences", "file_identity", "sample_sha256", "source_identity",
           "tokenizer_files", "tokenizer_identity"]

IDENTITY_VERSION = 1
"""``identity["version"]``; an identity of another version counts as a difference."""
_BLOCK = 4096
_BLOCKS = 16


def sample_sha256(path: str | os.PathLike, size: int) -> str:
    """SHA-256 (hex) of ``size`` and 16 blocks of 4 KiB spread evenly over the file (all of it
    when smaller)."""
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= _BLOCK * _BLOCKS:
            h.update(f.read())
        else:
            for i in range(_BLOCKS):
                f.seek((size - _BLOCK) * i // (_BLOCKS - 1))
                h.update(f.read(_BLOCK))
    return h.hexdigest()


def file_identity(path: str | os.PathLike) -> dict[str, Any]:
    """``{"path", "size" (bytes), "mtime_ns", "sample_sha256"}`` of one input file (path made absolute)."""
    p = pathlib.Path(os.path.abspath(pathlib.Path(path).expanduser()))
    st = p.stat()
    return {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sample_sha256": sample_sha256(p, st.st_size)}


def _input_identity(item: pathlib.Path | str) -> dict[str, Any]:
    if isinstance(item, str) and item.startswith("hf:"):
        return {"path": item, "fingerprint": str(getattr(hf_dataset(item), "_fingerprint", ""))}
    spec = str(item)
    base, split = pathlib.Path(spec), ""
    if isinstance(item, str) and not base.exists():  # DIR:SPLIT
        head, _, split = spec.rpartition(":")
        base = pathlib.Path(head)
    if base.is_dir():
        root = pathlib.Path(os.path.abspath(base.expanduser()))
        files = sorted(p for p in root.rglob("*") if p.is_file())
        return {"path": str(root) + (f":{split}" if split else ""),
                "files": [file_identity(p) for p in files]}
    return file_identity(base)


def source_identity(corpus: str, name: str = "") -> dict[str, Any]:
    """``{"name", "corpus", "inputs"}`` of one corpus (see the module docstring).

    Raises:
        shardlm.errors.DataError: the corpus cannot be read here (as
        :func:`shardlm.data.readers.plan_pieces`).
    """
    inputs, _ = expand_corpus(corpus)
    return {"name": name, "corpus": corpus, "inputs": [_input_identity(i) for i in inputs]}


def tokenizer_files(tokenizer_path: str | os.PathLike) -> dict[str, str] | None:
    """SHA-256 of ``tokenizer_path`` (as ``tokenizer.json``) and of the tokenizer files beside it; None if it
    is missing."""
    tok = pathlib.Path(tokenizer_path).expanduser()
    if not tok.is_file():
        return None
    out = {"tokenizer.json": hashlib.sha256(tok.read_bytes()).hexdigest()}
    for name in TOKENIZER_FILES[1:]:
        p = tok.parent / name
        if p.is_file():
            out[name] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def tokenizer_identity(tokenizer_path: str | None, vocab_size: int, sample_bytes: int) -> dict[str, Any]:
    """The ``tokenizer`` entry: a given tokenizer by its files' content; a trained one by its settings
    (``files`` is filled in once it is written, see :func:`tokenizer_files`)."""
    if tokenizer_path:
        return {"setting": tokenizer_path, "files": tokenizer_files(tokenizer_path)}
    return {"setting": "", "vocab_size": int(vocab_size), "sample_bytes": int(sample_bytes), "files": None}


def chat_template_identity(tokenizer_path: str) -> dict[str, Any]:
    """``{"sha256", "source"}`` of the chat template instruction data is rendered with (the tokenizer's or
    shardlm's default, as :class:`shardlm.data.chat.ChatTemplate` picks it)."""
    if not pathlib.Path(tokenizer_path).expanduser().is_file():
        return {"sha256": None, "source": f"{tokenizer_path} (no such file)"}
    files = read_tokenizer_config(tokenizer_path)
    template = files.chat_template or DEFAULT_CHAT_TEMPLATE
    return {"sha256": hashlib.sha256(template.encode("utf-8")).hexdigest(),
            "source": str(files.template_source or "shardlm's default chat template")}


def corpus_identity(sources: list[dict[str, Any]], text_field: str, tokenizer: dict[str, Any],
                    settings: dict[str, Any], chat_template: dict[str, Any] | None = None) -> dict[str, Any]:
    """An identity (see the module docstring) from its parts."""
    out = {"version": IDENTITY_VERSION, "sources": sources, "text_field": text_field, "tokenizer": tokenizer,
           "settings": settings}
    if chat_template is not None:
        out["chat_template"] = chat_template
    return out


def _q(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _file_change(old: dict[str, Any], new: dict[str, Any]) -> str:
    if old.get("size") != new.get("size"):
        return f"changed (size {old.get('size')} -> {new.get('size')} bytes)"
    if old.get("mtime_ns") != new.get("mtime_ns"):
        return "was modified (modification time changed)"
    return "changed (content differs)"


def _input_changes(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[str]:
    """What differs between two ``inputs`` lists (or a directory's ``files``): added, removed, changed."""
    before = {i["path"]: i for i in old}
    after = {i["path"]: i for i in new}
    out = [f"{p} added" for p in after if p not in before]
    out += [f"{p} removed" for p in before if p not in after]
    for path, n in after.items():
        o = before.get(path)
        if o is None or o == n:
            continue
        if "files" in n or "files" in o:
            out += [f"{path}: {c}" for c in _input_changes(o.get("files", []), n.get("files", []))]
        elif "fingerprint" in n:
            out.append(f"{path}: the dataset's fingerprint changed")
        else:
            out.append(f"{path} {_file_change(o, n)}")
    if not out and [i["path"] for i in old] != [i["path"] for i in new]:
        out.append("the inputs are read in another order")
    return out


def _limit(items: list[str], most: int = 3) -> list[str]:
    return items[:most] + ([f"and {len(items) - most} more"] if len(items) > most else [])


def _tokenizer_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    was, now = old.get("setting", ""), new.get("setting", "")
    if now:  # a given tokenizer: the same content is the same tokenizer, wherever it lies
        files = new.get("files")
        if files is None:
            return [f"data.tokenizer changed {_q(was)} -> {_q(now)} (no such file)" if was != now
                    else f"data.tokenizer {now} no longer exists"]
        if files == old.get("files"):
            return []
        if was != now:
            return [f"data.tokenizer changed {_q(was)} -> {_q(now)} (a tokenizer with other files)"]
        recorded = old.get("files") or {}
        changed = sorted(n for n in set(files) | set(recorded) if files.get(n) != recorded.get(n))
        return [f"data.tokenizer: {', '.join(changed)} beside {now} changed"]
    if was:
        return [f"data.tokenizer changed {_q(was)} -> \"\" (train a tokenizer)"]
    out = []
    if old.get("vocab_size") != new.get("vocab_size"):
        out.append(f"data.tokenizer_vocab_size (0: model.vocab_size) changed {old.get('vocab_size')} -> "
                   f"{new.get('vocab_size')} (the trained tokenizer's vocabulary)")
    if old.get("sample_bytes") != new.get("sample_bytes"):
        out.append(f"data.tokenizer_sample_bytes changed {old.get('sample_bytes')} -> "
                   f"{new.get('sample_bytes')}")
    return out


def differences(recorded: dict[str, Any] | None, expected: dict[str, Any]) -> list[str]:
    """Every way ``expected`` (what the config would prepare now) differs from ``recorded`` (a ``meta.json``'s
    identity), each naming the config key or the input file; empty when the preparation is current.

    ``recorded`` None (a directory written by a shardlm that kept no identity) is one difference.
    """
    if recorded is None:
        return ["it was prepared by an older shardlm that did not record what it was made from"]
    if recorded.get("version") != expected.get("version"):
        return [f"its record of what it was made from has version {recorded.get('version')}, "
                f"this shardlm writes {expected.get('version')}"]
    out: list[str] = []
    old_src, new_src = recorded.get("sources", []), expected["sources"]
    if [s.get("name") for s in old_src] != [s["name"] for s in new_src]:
        out.append(f"data.sources changed {_q([s.get('name') for s in old_src])} -> "
                   f"{_q([s['name'] for s in new_src])}")
    else:
        for o, n in zip(old_src, new_src):
            key = f"data.sources {n['name']!r}" if n["name"] else "data.corpus"
            changes = _input_changes(o.get("inputs", []), n["inputs"])
            if changes and o.get("corpus") != n["corpus"]:
                out.append(f"{key} changed {_q(o.get('corpus'))} -> {_q(n['corpus'])}")
            elif changes:
                out.append(f"{key} ({n['corpus']}): " + "; ".join(_limit(changes)))
    if recorded.get("text_field") != expected["text_field"]:
        out.append(
            f"data.text_field changed {_q(recorded.get('text_field'))} -> {_q(expected['text_field'])}"
        )
    if "chat_template" in expected and recorded.get("chat_template", {}).get("sha256") != \
            expected["chat_template"]["sha256"]:
        out.append(f"the chat template changed (now from {expected['chat_template']['source']})")
    out += _tokenizer_changes(recorded.get("tokenizer", {}), expected["tokenizer"])
    old_set, new_set = recorded.get("settings", {}), expected["settings"]
    for key in list(new_set) + [k for k in old_set if k not in new_set]:
        if old_set.get(key) != new_set.get(key):
            out.append(f"{key} changed {_q(old_set.get(key))} -> {_q(new_set.get(key))}")
    return out



def _dtype_name(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65536 else "uint32"


def describe_corpus(corpus: str, text_field: str, tokenizer_path: str | None, vocab_size: int,
                    val_fraction: float, piece_bytes: int, sample_bytes: int) -> dict[str, Any]:
    """The identity :func:`shardlm.data.prepare_corpus` records for these arguments (the same names and
    units); a trained tokenizer's ``files`` are None until it is written.

    Raises:
        shardlm.errors.DataError: the corpus cannot be read here.
    """
    settings = {"data.format": "text", "data.val_fraction": float(val_fraction),
                "data.piece_bytes": int(piece_bytes),
                "model.vocab_size (token dtype)": _dtype_name(vocab_size)}
    return corpus_identity([source_identity(corpus)], text_field,
                           tokenizer_identity(tokenizer_path, vocab_size, sample_bytes), settings)


def describe_mixture(
    sources: list[Any],
    names: list[str],
    text_field: str,
    tokenizer_path: str | None,
    vocab_size: int,
    val_fraction: float,
    piece_bytes: int,
    sample_bytes: int,
) -> dict[str, Any]:
    """The identity :func:`shardlm.data.mixture.prepare_mixture` records: every source's inputs, one tokenizer
    (trained: the sources' weights set each one's share of its sample, so they count too).

    Raises:
        shardlm.errors.DataError: a source cannot be read here.
    """
    settings: dict[str, Any] = {"data.format": "text", "data.val_fraction": float(val_fraction),
                                "data.piece_bytes": int(piece_bytes),
                                "model.vocab_size (token dtype)": _dtype_name(vocab_size)}
    if not tokenizer_path:
        settings["data.sources weights (the trained tokenizer's sample)"] = [float(s.weight) for s in sources]
    return corpus_identity([source_identity(s.path, n) for s, n in zip(sources, names)], text_field,
                           tokenizer_identity(tokenizer_path, vocab_size, sample_bytes), settings)


def describe_instructions(
    corpus: str, tokenizer_path: str, vocab_size: int, val_fraction: float
) -> dict[str, Any]:
    """The identity :func:`shardlm.data.instruct.prepare_instructions` records: the ``.jsonl``, the
    tokenizer's files and the chat template rendered with.

    Raises:
        shardlm.errors.DataError: the file or the tokenizer cannot be read here.
    """
    settings = {"data.format": "instruct", "data.val_fraction": float(val_fraction),
                "model.vocab_size (token dtype)": _dtype_name(vocab_size)}
    return corpus_identity([source_identity(corpus)], "messages",
                           tokenizer_identity(tokenizer_path, vocab_size, 0), settings,
                           chat_template=chat_template_identity(tokenizer_path))
