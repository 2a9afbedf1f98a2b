"""A job that torchrun restarted (``TORCHELASTIC_RESTART_COUNT`` above 0) resumes as with
``checkpoint.resume = "auto"``, unless a checkpoint is named. The checkpoint runs themselves are in
tests/dist/test_checkpoint.py."""

from __future__ import annotations


def test_torchelastic_restart_means_auto(monkeypatch):
    from shardlm.checkpoint.dcp import resume_mode
    from shardlm.config import load_config

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert resume_mode(load_config(None, [])) == ""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resume_mode(load_config(None, [])) == "auto"
    assert resume_mode(load_config(None, ['--checkpoint.resume="/x/step-5"'])) == "/x/step-5"
