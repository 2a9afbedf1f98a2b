"""Which parameters train: ``train.trainable`` / ``train.frozen`` name patterns, applied before FSDP.

A frozen parameter has ``requires_grad=False`` from the start: autograd computes no gradient for it, FSDP2
reduce-scatters only the gradients that exist (a group whose parameters are all frozen communicates none in
backward), and the optimizer (:func:`shardlm.train.optim.param_groups`) gives it no state. FSDP2 shards per
parameter, so frozen and trainable parameters may share one ``fully_shard`` group.

Pattern syntax: ``*`` matches any text (dots included), ``?`` one character, ``[a-b]`` (a, b integers) any
integer from a to b, everything else itself. A pattern matches a name if it matches the whole name or any
run of its dot-separated parts: ``embed_tokens`` matches ``model.embed_tokens.weight``, ``layers.[0-1]``
every parameter of blocks 0 and 1, ``model.layers.[0-11].*`` those of blocks 0 to 11.
"""

from __future__ import annotations

import re

from torch import nn

from shardlm.errors import ConfigError

_RANGE = re.compile(r"\[(\d+)-(\d+)\]")


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """The compiled regular expression of one name pattern (see the module docstring)."""
    out, pos = [], 0
    for m in _RANGE.finditer(pattern):
        out.append(_glob(pattern[pos:m.start()]))
        lo, hi = int(m.group(1)), int(m.group(2))
        out.append("(?:" + "|".join(str(i) for i in range(lo, hi + 1)) + ")")
        pos = m.end()
    out.append(_glob(pattern[pos:]))
    return re.compile("".join(out))


def _glob(text: str) -> str:
    return "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in text)


def name_matches(regex: re.Pattern[str], name: str) -> bool:
    """Whether ``regex`` fully matches ``name`` or a run of its dot-separated parts."""
    parts = name.split(".")
    return any(
        regex.fullmatch(".".join(parts[i:j])) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)
    )


def split_patterns(text: str) -> list[str]:
    """Comma-separated patterns, stripped, empty items dropped."""
    return [p.strip() for p in text.split(",") if p.strip()]


def apply_freeze(model: nn.Module, trainable: str, frozen: str) -> list[str]:
    """Set ``requires_grad`` from the patterns (in place, any device, before FSDP); return the
    trainable names.

    With ``trainable`` non-empty only the parameters matching one of its patterns train (empty: all of them);
    then those matching a ``frozen`` pattern are frozen. Names are ``named_parameters()``'s (a tied
    weight once).

    Raises:
        ConfigError: a pattern that matches no parameter (naming it and a few parameter names), or patterns
            that leave nothing to train.
    """
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    for key, text in (("train.trainable", trainable), ("train.frozen", frozen)):
        for pattern in split_patterns(text):
            regex = pattern_regex(pattern)
            if not any(name_matches(regex, n) for n in names):
                sample = ", ".join(names[:4] + ["..."] + names[-2:]) if len(names) > 6 else ", ".join(names)
                raise ConfigError(f"{key}: pattern {pattern!r} matches no parameter (names look like: "
                                  f"{sample})")
    regexes = [pattern_regex(p) for p in split_patterns(trainable)]
    for n, p in params.items():  # no trainable patterns: everything trains (also after an earlier freeze)
        p.requires_grad_(not regexes or any(name_matches(r, n) for r in regexes))
    for pattern in split_patterns(frozen):
        regex = pattern_regex(pattern)
        for n, p in params.items():
            if name_matches(regex, n):
                p.requires_grad_(False)
    train = [n for n, p in params.items() if p.requires_grad]
    if not train:
        raise ConfigError(f"train.trainable={trainable!r} / train.frozen={frozen!r} leave no parameter to "
                          "train")
    return train
