"""Chat templates: token ids equal transformers' apply_chat_template for five template styles; bad templates
and conversations give one clear error.

Each style is a small tokenizer_config.json written here (the templates are written for this test in the
style of Llama 3, Mistral [INST], ChatML, Gemma and Phi-3), with one small BPE tokenizer that knows every
style's special tokens. No downloads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conftest import cli_error
from shardlm.data.chat import ChatTemplate
from shardlm.data.instruct import read_instructions

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "instruct-shakespeare.jsonl"

SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "[INST]",
            "[/INST]", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<bos>", "<eos>", "<pad>", "<start_of_turn>",
            "<end_of_turn>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

STYLES = {
    "llama3": {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": (
            "{{ bos_token }}{% for message in messages %}"
            "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim "
            "+ '<|eot_id|>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")},
    "mistral": {
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": (
            "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
            "{% set turns = messages[1:] %}{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
            "{{ bos_token }}{% for message in turns %}"
            "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
            "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
            "{% if message['role'] == 'user' %}"
            "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
            "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}")},
    "chatml": {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "chat_template": (
            "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")},
    "gemma": {
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "chat_template": (
            "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
            "{% set first = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
            "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
            "{% for message in turns %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
            "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + message['content'] | trim "
            "+ '<end_of_turn>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")},
    "phi3": {
        "bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "chat_template": (
            "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")},
}

CHAT = [{"role": "system", "content": "You answer briefly, as a player would."},
        {"role": "user", "content": "Who wrote Hamlet?"},
        {"role": "assistant", "content": "William Shakespeare, about 1600."},
        {"role": "user", "content": "And Macbeth?"},
        {"role": "assistant", "content": "He did, too: a short, bloody play."}]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    """A 600-id byte-level BPE with every style's special tokens, trained on the example conversations."""
    texts = [m["content"] for _, msgs in read_instructions(str(EXAMPLES)) for m in msgs] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def style_dir(root: Path, tokenizer_json: Path, name: str, **changes) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({**STYLES.get(name, {}), **changes}))
    return d


@pytest.mark.parametrize("style", sorted(STYLES))
def test_ids_equal_apply_chat_template(style, tokenizer_json, tmp_path):
    d = style_dir(tmp_path, tokenizer_json, style)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    for use_transformers in (True, False):
        chat = ChatTemplate(d / "tokenizer.json", use_transformers=use_transformers)
        assert chat.backend == ("transformers" if use_transformers else "jinja2")
        # training: the whole two-turn chat; inference: up to the second question, with the generation prompt
        for messages, gen in ((CHAT, False), (CHAT[:4], True), (CHAT[:4], False)):
            ids, mask = chat.encode(messages, add_generation_prompt=gen)
            expected = list(hf.apply_chat_template(messages, add_generation_prompt=gen)["input_ids"])
            assert ids == expected and len(mask) == len(expected), (style, chat.backend, gen)
            assert chat.render(messages, gen) == hf.apply_chat_template(messages, tokenize=False,
                                                                         add_generation_prompt=gen)
        # the trained tokens are the two replies (and the template's end-of-turn text after each)
        ids, mask = chat.encode(CHAT)
        trained = hf.decode([i for i, m in zip(ids, mask) if m])
        assert trained.index(CHAT[2]["content"]) < trained.index(CHAT[4]["content"]), (style, trained)
        assert "Who wrote" not in trained and "Macbeth" not in trained and "briefly" not in trained, (style, trained)
    if style in ("llama3", "gemma", "mistral"):  # the template starts with bos_token: the first id is BOS
        assert ids[0] == hf.convert_tokens_to_ids(STYLES[style]["bos_token"])
    print(f"\n{style}: {len(ids)} ids equal apply_chat_template's, {sum(mask)} trained")


def _prepare(d: Path, data: Path, out: Path) -> list[str]:
    return ["prepare", "--config", str(ROOT / "configs/shakespeare-tiny.toml"), "--data.format=instruct",
            f"--data.corpus={data}", f"--data.tokenizer={d / 'tokenizer.json'}", f"--data.dir={out}"]


def test_bad_chat_input(tokenizer_json, tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps({"messages": m}) for m in (CHAT[1:3], CHAT)) + "\n")
    out = tmp_path / "out"
    # a template that does not compile: the file and the template's line
    d = style_dir(tmp_path, tokenizer_json, "syntax", chat_template="{% for m in messages %}\n{{ m['content'] }\n")
    err = cli_error(capsys, _prepare(d, data, out))
    assert f"{d / 'tokenizer_config.json'}: the chat template does not compile: template line 2" in err, err
    # a template that fails while rendering: the JSONL line, the template's file and its own error text
    d = style_dir(tmp_path, tokenizer_json, "undefined", chat_template="{{ messages[0]['content'].nothing.here }}")
    err = cli_error(capsys, _prepare(d, data, out))
    assert err.startswith(f"error: {data}:1: the chat template ({d / 'tokenizer_config.json'}) failed") and \
        "UndefinedError" in err and "nothing" in err, err
    # a role the template rejects (raise_exception in the template)
    d = style_dir(tmp_path, tokenizer_json, "mistral")
    bad = tmp_path / "roles.jsonl"
    bad.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": [
        {"role": "user", "content": "Hi"}, {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "Hello"}]}) + "\n")
    err = cli_error(capsys, _prepare(d, bad, out))
    assert err.startswith(f"error: {bad}:2: the chat template ({d / 'tokenizer_config.json'}) failed") and \
        "Conversation roles must alternate user/assistant/user/assistant/..." in err, err
    # a row without messages
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"text": "no chat here"}) + "\n")
    err = cli_error(capsys, _prepare(d, rows, out))
    assert err == f"error: {rows}:2: missing field 'messages' (or 'prompt' and 'response')", err
    assert not out.exists()
