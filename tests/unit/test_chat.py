"""Chat templates: token ids equal transformers' apply_chat_template for five template styles; response masks
equal transformers' assistant masks of generation-marked equivalents (and Qwen3's real template); bad
templates and conversations give one clear error.

Each style is a small tokenizer_config.json written here (the templates are written for this test in the
style of Llama 3, Mistral [INST], ChatML, Gemma and Phi-3), with one small BPE tokenizer that knows every
style's special tokens. ``fixtures/qwen3_chat_template.jinja`` is the ``chat_template`` of Qwen/Qwen3-0.6B's
``tokenizer_config.json`` (public, Apache-2.0), verbatim. No downloads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from conftest import cli_error
from shardlm.cli.main import main as shardlm_main
from shardlm.data.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from shardlm.data.instruct import read_instructions
from shardlm.errors import DataError

transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "instruct-shakespeare.jsonl"

SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>",
            "[INST]", "[/INST]", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<bos>", "<eos>", "<pad>",
            "<start_of_turn>", "<end_of_turn>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

STYLES = {
    "llama3": {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": (
            "{{ bos_token }}{% for message in messages %}"
            "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | "
            "trim + '<|eot_id|>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif "
            "%}")},
    "mistral": {
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": (
            "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
            "{% set turns = messages[1:] %}{% else %}{% set system = '' %}{% set turns = messages %}{% endif "
            "%}{{ bos_token }}{% for message in turns %}"
            "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
            "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% "
            "endif %}{% if message['role'] == 'user' %}"
            "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
            "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}")},
    "chatml": {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "chat_template": (
            "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% "
            "endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")},
    "gemma": {
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "chat_template": (
            "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
            "{% set first = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
            "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
            "{% for message in turns %}{% set role = 'model' if message['role'] == 'assistant' else "
            "message['role'] %}{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + "
            "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")},
    "phi3": {
        "bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "chat_template": (
            "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + "
            "'<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ "
            "eos_token }}{% endif %}")},
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
    tok.train_from_iterator(texts,
                            trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # as in Qwen3's tokenizer: added tokens that are not special
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
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
        assert "Who wrote" not in trained and "Macbeth" not in trained and "briefly" not in trained, (
            style,
            trained,
        )
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
    d = style_dir(tmp_path, tokenizer_json, "syntax",
                  chat_template="{% for m in messages %}\n{{ m['content'] }\n")
    err = cli_error(capsys, _prepare(d, data, out))
    assert f"{d / 'tokenizer_config.json'}: the chat template does not compile: template line 2" in err, err
    # a template that fails while rendering: the JSONL line, the template's file and its own error text
    d = style_dir(tmp_path, tokenizer_json, "undefined",
                  chat_template="{{ messages[0]['content'].nothing.here }}")
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


# ---- response masks: equal to transformers' assistant masks of generation-marked equivalents ----------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
QWEN3 = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
         "chat_template": (FIXTURES / "qwen3_chat_template.jinja").read_text()}

#: each style with ``{% generation %}`` around what the model generates: its reply and end-of-turn token
MARKED = {
    "llama3": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' "
        "}}{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    "mistral": STYLES["mistral"]["chat_template"].replace(
        "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}",
        "{% else %}{% generation %}{{ ' ' + message['content'] + eos_token }}{% endgeneration %}{% endif %}"),
    "chatml": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['role'] == 'assistant' %}"
        "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
        "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
        "{% set first = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
        "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
        "{% for message in turns %}{% set role = 'model' if message['role'] == 'assistant' else "
        "message['role'] %}{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') }}{% if "
        "message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<end_of_turn>' "
        "}}{% endgeneration %}{% else %}{{ message['content'] | trim + '<end_of_turn>' }}{% endif %}{{ '\n' "
        "}}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"),
    "phi3": (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' }}{% if message['role'] == "
        "'assistant' %}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
        "{% else %}{{ message['content'] + '<|end|>' }}{% endif %}{{ '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif "
        "%}"),
    "default": (
        "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ 'assistant:' }}{% generation "
        "%}{{ ' ' + message['content'] + eos_token }}{% endgeneration %}{% else %}"
        "{{ message['role'] + ': ' + message['content'] }}{% endif %}{{ '\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"),
    # a generation prompt that the rendered turn lacks (DeepSeek R1 style): the prompt is not a prefix of
    # the chat
    "think-prompt": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor "
        "%}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}"),
}
MASK_STYLES = {**STYLES, "default": {"eos_token": "<|endoftext|>", "chat_template": DEFAULT_CHAT_TEMPLATE},
               "think-prompt": {"eos_token": "<|im_end|>", "chat_template": (
                   "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
                   "message['content'] + '<|im_end|>\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}")}}
END_OF_TURN = {"llama3": "<|eot_id|>", "mistral": "</s>", "chatml": "<|im_end|>", "gemma": "<end_of_turn>",
               "phi3": "<|end|>", "default": "<|endoftext|>", "think-prompt": "<|im_end|>",
               "qwen3": "<|im_end|>"}

THREE = [{"role": "user", "content": "Who wrote Hamlet?"},
         {"role": "assistant", "content": "William Shakespeare, about 1600."},
         {"role": "user", "content": "And Macbeth?"},
         {"role": "assistant", "content": "He did, too: a short, bloody play."},
         {"role": "user", "content": "Which is longer?"},
         {"role": "assistant", "content": "Hamlet, by far: his longest play."}]
REASONING = ["The question names a play; its author is well known.", "Same author, a later tragedy.",
             "Compare line counts: about 4,000 and 2,100."]
#: the replies' reasoning as a field (Qwen3's ``reasoning_content``) and inside the content
#: (``<think>...</think>``)
THREE_REASONING = [dict(m, reasoning_content=REASONING[i // 2]) if m["role"] == "assistant" else m
                   for i, m in enumerate(THREE)]
THREE_THINK = [dict(m, content=f"<think>\n{REASONING[i // 2]}\n</think>\n\n{m['content']}")
               if m["role"] == "assistant" else m for i, m in enumerate(THREE)]


def _hf_masks(d: Path, template: str, messages: list[dict]) -> tuple[list[int], list[int], str]:
    """transformers' ids, assistant mask and text for ``messages`` with ``template`` (generation-marked)."""
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    out = hf.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"]), hf.apply_chat_template(
        messages, chat_template=template, tokenize=False)


def _runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The ids of each maximal run of response tokens."""
    runs: list[list[int]] = []
    for i, (t, m) in enumerate(zip(ids, mask)):
        if m:
            (runs[-1].append(t) if i and mask[i - 1] else runs.append([t]))
    return runs


def _check_masks(style: str, config: dict, marked: str, conversations: list[list[dict]], tokenizer_json: Path,
                 root: Path) -> None:
    """For each conversation and both renderers: the mask of the unmarked template equals transformers' mask
    of the marked one (same text, same ids); the marked template through ChatTemplate gives the same; each
    reply is one run of response tokens that holds its text and ends with the end-of-turn token."""
    d = style_dir(root, tokenizer_json, style, **config)
    dm = style_dir(root, tokenizer_json, style + "-marked", **{**config, "chat_template": marked})
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    for messages in conversations:
        ids, mask, text = _hf_masks(d, marked, messages)
        assert text == hf.apply_chat_template(messages, tokenize=False), (style,
                                                                          "the marked template differs")
        replies = [m for m in messages if m["role"] == "assistant"]
        for use_transformers in (True, False):
            out = ChatTemplate(d / "tokenizer.json", use_transformers=use_transformers).encode_chat(messages)
            assert out.ids == ids and out.mask == mask, (style, use_transformers, messages[-1])
            assert out.turns == out.supervised == len(replies)
        marked_out = ChatTemplate(dm / "tokenizer.json").encode_chat(messages)
        assert (marked_out.ids, marked_out.mask, marked_out.supervised) == (ids, mask, len(replies))
        runs = [hf.decode(r) for r in _runs(ids, mask)]
        assert len(runs) == len(replies), (style, runs)
        for run, reply in zip(runs, replies):
            assert reply["content"].split("</think>")[-1].strip() in run and run.endswith(
                END_OF_TURN[style]
            ), (style, run)
    print(f"\n{style}: masks equal transformers' generation-marked ones; {sum(mask)} of {len(ids)} tokens "
          f"trained in the last chat, runs {runs}")


@pytest.mark.parametrize("style", sorted(MARKED))
def test_masks_equal_generation_marked_templates(style, tokenizer_json, tmp_path):
    _check_masks(style, MASK_STYLES[style], MARKED[style], [CHAT, THREE], tokenizer_json, tmp_path)


def test_qwen3_every_reply_is_supervised(tokenizer_json, tmp_path):
    """Qwen3's real template, which drops <think></think> from every reply but the last: all three replies are
    trained, with and without reasoning; masks equal the generation-marked Qwen3 template's."""
    template = QWEN3["chat_template"]
    marked = template
    for old, new, count in (
            ("{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content",
             "{{- '<think>\\n' + reasoning_content", 1),
            ("{{- '<|im_start|>' + message.role + '\\n' + content }}", "{{- content }}", 2),
            ("{%- if loop.index0 > ns.last_query_index %}",
             "{{- '<|im_start|>' + message.role + '\\n' }}{%- generation %}{%- if loop.index0 > "
             "ns.last_query_index %}",
             1),
            ("{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
             "{{- '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}\n    {%- elif message.role == \"tool\" %}",
             1)):
        assert marked.count(old) == count, old
        marked = marked.replace(old, new)
    d = style_dir(tmp_path, tokenizer_json, "qwen3", **QWEN3)
    chat = ChatTemplate(d / "tokenizer.json")
    full = chat.render(THREE)
    # the template is not prefix-preserving: the first reply alone renders with an empty think block
    assert "<think>\n\n</think>\n\n" + THREE[1]["content"] in chat.render(THREE[:2])
    assert not full.startswith(chat.render(THREE[:2])) and full.count("<think>") == 1
    assert chat.render(THREE_REASONING).count(REASONING[2]) == 1 and REASONING[0] not in chat.render(
        THREE_REASONING
    )
    _check_masks("qwen3", QWEN3, marked, [THREE, THREE_REASONING, THREE_THINK, THREE[:2], CHAT],
                 tokenizer_json, tmp_path)
    trained = chat.tokenizer.decode([i for i, m in zip(*chat.encode(THREE_REASONING)) if m],
                                    skip_special_tokens=False)
    assert trained == (f"{THREE[1]['content']}<|im_end|>{THREE[3]['content']}<|im_end|>"
                       f"<think>\n{REASONING[2]}\n</think>\n\n{THREE[5]['content']}<|im_end|>"), trained


def test_masks_of_templates_that_cannot_be_located(tokenizer_json, tmp_path, capsys):
    """An assistant turn whose span cannot be found is an error naming the .jsonl line, never
    left untrained."""
    data = tmp_path / "chats.jsonl"
    data.write_text(
        json.dumps({"prompt": "Hi", "response": "OK"}) + "\n" + json.dumps({"messages": CHAT}) + "\n"
    )
    out = tmp_path / "out"
    chatml = STYLES["chatml"]["chat_template"]
    # the reply rendered in upper case: line 1 ("OK") is found, line 2 is not
    d = style_dir(tmp_path, tokenizer_json, "upper", **{**STYLES["chatml"], "chat_template": chatml.replace(
        "message['content'] + '<|im_end|>'",
        "(message['content'] | upper if message['role'] == 'assistant' else message['content']) + "
        "'<|im_end|>'")})
    err = cli_error(capsys, _prepare(d, data, out))
    assert (
        err.startswith(
            f"error: {data}:2: assistant message 2: the chat template "
            f"({d / 'tokenizer_config.json'}) does not render its content"
        )
        and "{% generation %}" in err
    ), err
    # no end-of-turn token after a reply (Mistral's template without eos_token): the next [INST] is not taken
    # for it
    d = style_dir(tmp_path, tokenizer_json, "no-eos",
                  **{**STYLES["mistral"], "chat_template": STYLES["mistral"][
        "chat_template"].replace("' ' + message['content'] + eos_token", "' ' + message['content']")})
    err = cli_error(capsys, _prepare(d, data, out))
    assert (
        err.startswith(f"error: {data}:1: assistant message 1:")
        and "puts no special token after the reply" in err
    )
    # a history rendered differently once a reply follows (the last user turn marked): the reply's start
    # is unknown
    d = style_dir(tmp_path, tokenizer_json, "last-mark",
                  **{**STYLES["chatml"], "chat_template": chatml.replace(
        "message['content'] + '<|im_end|>'",
        "message['content'] + (' (last)' if loop.last else '') + '<|im_end|>'")})
    err = cli_error(capsys, _prepare(d, data, out))
    assert (
        err.startswith(f"error: {data}:1: assistant message 1:") and "differently in the whole chat" in err
    ), err
    # text after the first special token of a reply (a signature, a tool call): which token ends the turn
    # is unknown
    d = style_dir(tmp_path, tokenizer_json, "signed", **{**STYLES["chatml"], "chat_template": chatml.replace(
        "message['content'] + '<|im_end|>'",
        "message['content'] + ('<|endoftext|> (signed)' if message['role'] == 'assistant' else '') + "
        "'<|im_end|>'")})
    err = cli_error(capsys, _prepare(d, data, out))
    assert (
        err.startswith(f"error: {data}:1: assistant message 1:")
        and "prints text after the reply's first special token '<|endoftext|>' ('(signed)')" in err
    ), err
    assert not out.exists()
    # a generation-marked template needs transformers for its mask (a prompt without replies does not)
    dm = style_dir(tmp_path, tokenizer_json, "marked",
                   **{**STYLES["chatml"], "chat_template": MARKED["chatml"]})
    chat = ChatTemplate(dm / "tokenizer.json", use_transformers=False)
    with pytest.raises(DataError,
                       match=r"line 7: the chat template .* marks replies with \{% generation %\}; .* "
                                        r"transformers, which is not installed"):
        chat.encode(CHAT, where="line 7")
    hf = transformers.AutoTokenizer.from_pretrained(str(dm))
    assert chat.encode(CHAT[:2], True)[0] == list(
        hf.apply_chat_template(CHAT[:2], add_generation_prompt=True)["input_ids"]
    )


def test_prepare_reports_assistant_turns_per_split(tokenizer_json, tmp_path, capsys):
    rows = [{"messages": CHAT}, {"messages": THREE}, {"prompt": "Hi", "response": "Hello"},
            {"messages": THREE}]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = style_dir(tmp_path, tokenizer_json, "chatml")
    capsys.readouterr()
    assert shardlm_main(_prepare(d, data, tmp_path / "out") + ["--data.val_fraction=0.25"]) == 0
    err = capsys.readouterr().err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["assistant_turns"] == {"train": {"found": 6, "supervised": 6},
                                       "val": {"found": 3, "supervised": 3}}
    assert f"prepare: {data}: assistant turns found / supervised: train 6 / 6, val 3 / 3" in err, err
    # a {% generation %} template that supervises only the last reply: said in the summary, not an error
    last_only = MARKED["chatml"].replace("{% if message['role'] == 'assistant' %}",
                                         "{% if message['role'] == 'assistant' and loop.last %}")
    assert last_only != MARKED["chatml"]
    dm = style_dir(tmp_path, tokenizer_json, "last-only", **{**STYLES["chatml"], "chat_template": last_only})
    assert shardlm_main(_prepare(dm, data, tmp_path / "out2") + ["--data.val_fraction=0.25"]) == 0
    err = capsys.readouterr().err
    assert json.loads((tmp_path / "out2" / "meta.json").read_text())["assistant_turns"] == {
        "train": {"found": 6, "supervised": 3}, "val": {"found": 3, "supervised": 1}}
    assert ("assistant turns found / supervised: train 6 / 3, val 3 / 1 (5 left out by the template's "
            "{% generation %} blocks)") in err, err
