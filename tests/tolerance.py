"""Numeric comparisons of the test suite, with bounds scaled to the values compared.

CPUs differ (with and without AVX-512, other BLAS kernels, other summation orders), so a bound in absolute
units holds on one machine and not on the next. Every bound here is relative: an error is compared with
``rtol * scale``, where ``scale`` is the magnitude of the reference values (their largest absolute value by
default, or their norm for :func:`assert_norm_close`). ``rtol`` is stated in units of fp32's machine epsilon
(:data:`EPS`, 2**-23 = 1.19e-7) where the comparison is of fp32 arithmetic done in another order, so that a
bound reads as "so many roundings of the largest value".

Every comparison is recorded when the environment variable ``SHARDLM_TOLERANCE_LOG`` names a file: one JSON
line per comparison (the pytest node id from ``PYTEST_CURRENT_TEST``, the rank under torchrun, the calling
file and line, the label, the measured error, the bound, the scale and their ratio), appended with a single
``write`` to a file opened for appending, so the ranks and tests of one run can share the file.
``python tests/tolerance.py FILE [N]`` prints the N comparisons closest to their bounds.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence

import torch

#: fp32's machine epsilon, 2**-23: the spacing of fp32 numbers in [1, 2)
EPS = torch.finfo(torch.float32).eps
#: the environment variable that names the log file (JSON lines)
LOG_ENV = "SHARDLM_TOLERANCE_LOG"


def _caller() -> str:
    """``file:line`` of the first frame outside this module (the test's comparison)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def record(err: float, bound: float, scale: float, what: str = "") -> None:
    """Append one comparison to the log named by ``SHARDLM_TOLERANCE_LOG`` (nothing when it is unset).

    One line of JSON, written with one ``os.write`` on a descriptor opened with ``O_APPEND``: lines from
    several processes (the ranks of a torchrun launch, parallel pytest workers) do not interleave."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    entry = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0],
        "rank": int(os.environ.get("RANK", "0")),
        "where": _caller(),
        "what": what,
        "err": err,
        "bound": bound,
        "scale": scale,
        "ratio": err / bound if bound > 0 else (0.0 if err == 0 else math.inf),
    }
    line = (json.dumps(entry) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def check(err: float, bound: float, *, scale: float = 1.0, what: str = "") -> float:
    """Assert ``err <= bound`` for an error measured elsewhere (e.g. reported by a torchrun worker); record
    it. ``bound`` must already be scaled (``rtol * scale``); ``scale`` is for the record and the message.
    Returns ``err``. Raises AssertionError naming the error, the bound and the scale."""
    err, bound, scale = float(err), float(bound), float(scale)
    record(err, bound, scale, what)
    assert err <= bound, (
        f"{what or 'comparison'}: error {err:.3e} > bound {bound:.3e} "
        f"(ratio {err / bound if bound else math.inf:.2f}, scale {scale:.3e})")
    return err


def _tensor(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64)
    return torch.as_tensor(x, dtype=torch.float64)


def assert_close(actual, expected, *, rtol: float, scale: float | None = None, what: str = "") -> float:
    """Assert ``max|actual - expected| <= rtol * scale``, ``scale`` = ``max|expected|`` unless given.

    ``actual``/``expected``: tensors (any shape and float dtype, compared in float64), numbers, or sequences
    of numbers, of the same shape. ``scale``: the magnitude the error is relative to, when the reference's
    own maximum is not it (e.g. a loss's difference relative to the loss, over several steps: pass the
    largest loss). Returns the measured error. Raises AssertionError (error, bound, scale, ratio) when the
    bound is exceeded or the shapes differ."""
    a, b = _tensor(actual), _tensor(expected)
    assert a.shape == b.shape, f"{what or 'comparison'}: shapes {tuple(a.shape)} != {tuple(b.shape)}"
    if scale is None:
        scale = b.abs().max().item() if b.numel() else 0.0
    err = (a - b).abs().max().item() if a.numel() else 0.0
    if math.isnan(err):
        raise AssertionError(f"{what or 'comparison'}: NaN in the values compared")
    return check(err, rtol * scale, scale=scale, what=what)


def assert_norm_close(actual, expected, *, rtol: float, what: str = "") -> float:
    """Assert ``||actual - expected|| <= rtol * ||expected||`` (Euclidean norms over all elements; tensors,
    or mappings name -> tensor taken together as one vector, the same keys). For gradients and parameters,
    where the largest element is not the measure of a whole. Returns ``||actual - expected||``."""
    if isinstance(expected, Mapping):
        assert actual.keys() == expected.keys(), f"{what}: keys differ"
        a = torch.cat([_tensor(actual[k]).flatten() for k in expected])
        b = torch.cat([_tensor(expected[k]).flatten() for k in expected])
    else:
        a, b = _tensor(actual).flatten(), _tensor(expected).flatten()
    scale = b.norm().item()
    return check((a - b).norm().item(), rtol * scale, scale=scale, what=what)


def assert_all_close(actual: Mapping, expected: Mapping, *, rtol: float, what: str = "") -> float:
    """:func:`assert_close` over mappings name -> tensor with the same keys (e.g. two state dicts), the scale
    the largest absolute value over all of ``expected``'s tensors; returns the largest error."""
    assert actual.keys() == expected.keys(), f"{what}: keys differ: {sorted(set(actual) ^ set(expected))}"
    scale = max((_tensor(v).abs().max().item() for v in expected.values() if v.numel()), default=0.0)
    err = max(((_tensor(actual[k]) - _tensor(expected[k])).abs().max().item()
               for k in expected if expected[k].numel()), default=0.0)
    return check(err, rtol * scale, scale=scale, what=what)


def read_log(path: str) -> list[dict]:
    """The entries of a log written by :func:`record` (a line that is not JSON is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def closest(entries: Iterable[dict], n: int = 15) -> list[dict]:
    """The ``n`` entries with the largest ratio error / bound, each (test, where, what) once (its largest)."""
    best: dict[tuple, dict] = {}
    for e in entries:
        key = (e["test"], e["where"], e["what"])
        if key not in best or e["ratio"] > best[key]["ratio"]:
            best[key] = e
    return sorted(best.values(), key=lambda e: -e["ratio"])[:n]


def report(entries: Sequence[dict], n: int = 15) -> str:
    """A table of the :func:`closest` comparisons: ratio, error, bound, scale, test, place, label."""
    rows = [f"{len(entries)} comparisons logged; the {min(n, len(entries))} closest to their bounds:",
            f"{'ratio':>7} {'error':>10} {'bound':>10} {'scale':>10}  test / where / what"]
    for e in closest(entries, n):
        rows.append(f"{e['ratio']:7.3f} {e['err']:10.3e} {e['bound']:10.3e} {e['scale']:10.3e}  "
                    f"{e['test']}  {e['where']}  {e['what']}")
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python tests/tolerance.py LOG.jsonl [N]")
    print(report(read_log(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 15))
