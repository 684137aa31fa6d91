"""What the HTTP API renders and sends as text, without a daemon: chat templates as transformers
renders them (or the plain fallback), and streamed text that never splits a character nor sends
part of a stop string."""

from __future__ import annotations

import json

import pytest

from daemon.text import TextStream
from engine.chat_template import ChatTemplate, ChatTemplateError
from engine.checkpoint import Checkpoint, load_checkpoint
from tests.conftest import DEFAULT_TARGET


@pytest.fixture(scope="module")
def target() -> Checkpoint:
    return load_checkpoint(DEFAULT_TARGET)


def test_text_stream_never_splits_a_character_nor_sends_part_of_a_stop_string(target):
    tokens = target.tokenizer.encode("naïve café: 世界, déjà vu. END of story").ids
    full = target.tokenizer.decode(tokens)
    for stop in ((), ("END",), ("ZZZ", "vu.")):
        expected = full[: min([full.find(s) for s in stop if s in full], default=len(full))]
        stream, sent = TextStream(target.tokenizer, stop), ""
        for i, token in enumerate(tokens):  # one token per step, as speculation with k = 0 emits them
            sent += stream.push([token], final=i == len(tokens) - 1)
            assert expected.startswith(sent)  # nothing sent is ever taken back
        assert sent == expected == stream.text


def test_chat_template_from_the_checkpoint_or_the_plain_fallback(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ChatTemplate.from_checkpoint(tmp_path).render(messages) == "system: Be brief.\nuser: Hi\nassistant: "
    source = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    config = {"chat_template": source, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.from_checkpoint(tmp_path)
    assert template.render(messages) == "<s><|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
    assert template.adds_special_tokens
    with pytest.raises(ChatTemplateError, match="no tools"):
        template.render([{"role": "tool", "content": "x"}])
    # As transformers renders them: `tools` and `documents` are none, not undefined, and a
    # message's name reaches the template.
    source = "{% if tools is not none %}TOOLS{% endif %}{% for m in messages %}{{ m.name }}:{{ m.content }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
    assert ChatTemplate.from_checkpoint(tmp_path).render([{"role": "user", "content": "Hi", "name": "ada"}]) == "ada:Hi"


def test_chat_templates_get_what_transformers_gives_them(tmp_path):
    hi = [{"role": "user", "content": "héllo"}]
    # tojson with json.dumps' options, the special tokens besides bos and eos, the generation tag.
    source = (
        "{{ messages | tojson(ensure_ascii=True, separators=(',', ':'), sort_keys=True) }}|{{ pad_token }}|"
        "{% generation %}{{ messages[0].content }}{% endgeneration %}"
    )
    config = {"chat_template": source, "pad_token": {"content": "<pad>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    rendered = ChatTemplate.from_checkpoint(tmp_path).render(hi)
    assert rendered == '[{"content":"h\\u00e9llo","role":"user"}]|<pad>|héllo'
    # A chat_template.jinja beside the config's template is the one used, as transformers does.
    (tmp_path / "chat_template.jinja").write_text("JINJA {{ messages[0].content }}")
    assert ChatTemplate.from_checkpoint(tmp_path).render(hi) == "JINJA héllo"
    # A template failing on the messages is the request's error, not the server's; one that cannot
    # compile is named when the checkpoint is read.
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content + 1 }}")
    with pytest.raises(ChatTemplateError, match="failed on the messages"):
        ChatTemplate.from_checkpoint(tmp_path).render(hi)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate.from_checkpoint(tmp_path)
