"""tests/tolerance.py: scaled comparisons fail with the error, the bound and the scale in the message, and
every comparison is logged (one JSON line, appended) when SHARDLM_TOLERANCE_LOG names a file."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import tolerance
from tolerance import EPS, assert_all_close, assert_close, assert_norm_close, check


def test_bound_scales_with_the_reference(monkeypatch):
    """The same relative error passes at any magnitude; an error over the scaled bound fails, naming it."""
    monkeypatch.delenv(tolerance.LOG_ENV, raising=False)
    ref = torch.tensor([1.0, -2.0, 0.5])
    for magnitude in (1e-3, 1.0, 1e4):
        assert assert_close(ref * magnitude * (1 + 4 * EPS), ref * magnitude, rtol=16 * EPS) > 0
        with pytest.raises(AssertionError, match=r"logits: error .* > bound .*scale"):
            assert_close(ref * magnitude * (1 + 1e-5), ref * magnitude, rtol=16 * EPS, what="logits")
    assert assert_close([5.0, 4.0], [5.0, 4.0], rtol=0) == 0.0  # rtol 0: bitwise
    with pytest.raises(AssertionError, match="shapes"):
        assert_close(torch.zeros(2), torch.zeros(3), rtol=1.0)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(torch.tensor([float("nan")]), torch.zeros(1), rtol=1.0)
    assert_close(3.0, 3.0 + 1e-7, rtol=1e-7, scale=4.0)  # an explicit scale
    with pytest.raises(AssertionError):
        assert_close(3.0, 3.0 + 1e-7, rtol=1e-7, scale=0.5)


def test_norm_and_mapping_comparisons(monkeypatch):
    monkeypatch.delenv(tolerance.LOG_ENV, raising=False)  # g: norm 5, largest element 4
    g = {"a": torch.tensor([3.0, 0.0], dtype=torch.float64), "b": torch.tensor([4.0], dtype=torch.float64)}
    assert_norm_close({"a": torch.tensor([3.0, 4e-6]), "b": torch.tensor([4.0])}, g, rtol=1e-6)
    with pytest.raises(AssertionError):
        assert_norm_close({"a": torch.tensor([3.0, 6e-6]), "b": torch.tensor([4.0])}, g, rtol=1e-6)
    assert assert_all_close({"a": g["a"] + 3e-6, "b": g["b"]}, g, rtol=1e-6) == pytest.approx(3e-6, rel=1e-3)
    with pytest.raises(AssertionError):  # scale 4 (the largest of all): 5e-6 > 4e-6
        assert_all_close({"a": g["a"] + 5e-6, "b": g["b"]}, g, rtol=1e-6)
    with pytest.raises(AssertionError, match="keys"):
        assert_all_close({"a": g["a"]}, g, rtol=1.0)
    with pytest.raises(AssertionError, match=r"loss: error 2.000e-03 > bound 1.000e-03"):
        check(2e-3, 1e-3, what="loss")


def test_log_lines_and_report(tmp_path, monkeypatch):
    """One line per comparison with the node id, the place, error, bound and ratio; failed ones too; the
    report lists the closest first; lines from another process append to the same file."""
    log = tmp_path / "tol.jsonl"
    monkeypatch.setenv(tolerance.LOG_ENV, str(log))
    assert_close(torch.tensor([1.0 + 2 ** -20]), torch.tensor([1.0]), rtol=2 ** -19, what="half")
    with pytest.raises(AssertionError):
        check(3.0, 2.0, scale=2.0, what="over")
    code = "import tolerance; tolerance.check(1.0, 10.0, what='child')"
    subprocess.run([sys.executable, "-c", code], check=True, env={**__import__("os").environ,
                   "PYTHONPATH": str(tolerance.__file__).rsplit("/", 1)[0], "RANK": "1"})
    entries = tolerance.read_log(str(log))
    assert [e["what"] for e in entries] == ["half", "over", "child"]
    half = entries[0]
    assert half["test"].endswith("test_tolerance.py::test_log_lines_and_report")
    assert half["where"].startswith("test_tolerance.py:") and half["ratio"] == pytest.approx(0.5)
    assert entries[2]["rank"] == 1 and entries[2]["ratio"] == pytest.approx(0.1)
    lines = tolerance.report(entries, 2).splitlines()
    assert "3 comparisons" in lines[0] and len(lines) == 4
    assert "over" in lines[2] and "half" in lines[3]
