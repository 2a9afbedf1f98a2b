"""Reading a JSON file with one clear error that names it (a leaf: imports nothing of shardlm)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_json(path: str | os.PathLike, error: type[Exception], expect: type = dict,
              message: str = "{path}: {reason}") -> Any:
    """The JSON value in the file ``path`` (UTF-8), which must be an instance of ``expect`` (``object``:
    any value).

    Args:
        path: the file.
        error: the exception type raised, with a message that starts with ``path`` (the caller's error type:
            ``DataError``, ``CheckpointError``, ``ModelDirError``...).
        expect: the type the top-level value must have; ``dict`` by default (a JSON object).
        message: the error's text, with ``{path}``, ``{reason}`` (one of those below, after ``<path>: ``) and
            ``{cause}`` (the reason's parenthesis alone: the OS's or the JSON decoder's words, or
            ``expected a JSON object``) filled in: a caller that says what the file is for, or what to do,
            writes it here (e.g. ``"{path}: not a safetensors index ({reason})"``).

    Raises:
        error: ``"<path>: cannot be read (<reason>)"`` (missing, a directory, no permission),
            ``"<path>: not valid JSON (<reason>)"`` (or not UTF-8), ``"<path>: expected a JSON object"``
            (another type; the type's name for an ``expect`` other than dict), or ``message`` filled in.
    """
    path = Path(path)

    def fail(what: str, cause: object) -> Exception:
        reason = f"{what} ({cause})" if what else str(cause)
        return error(message.format(path=path, reason=reason, cause=cause))

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise fail("not valid JSON", e) from None
    except OSError as e:
        raise fail("cannot be read", e.strerror or e) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise fail("not valid JSON", e) from None
    if not isinstance(value, expect):
        raise fail("", f"expected a JSON {'object' if expect is dict else expect.__name__}")
    return value
