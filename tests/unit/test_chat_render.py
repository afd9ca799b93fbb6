"""Chat templates rendered under limits: the same text as transformers, hostile ones refused at load."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from gguf_fixtures import TinySpec, with_tiny_tokenizer, write_gguf
from kvserve.chat.bounded_jinja import TemplateLimits
from kvserve.chat.encode import encode_chat
from kvserve.chat.render import check_chat_template, install_chat_template, render_chat
from kvserve.errors import ChatTemplateError, ModelLoadError
from kvserve.loader import load_tokenizer, resolve_model
from model_fixtures import save_tiny_model, train_tiny_tokenizer

# Templates in the style of the ones models ship: tools listed as JSON, calls and
# results in their own turns, a system message folded into the first user turn,
# content given as parts, date stamps, namespaces, macros, {% generation %}.
TOOLS_TEMPLATE = """\
{%- if tools %}
{{- '<s>system\\n' }}{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}{{ '\\n' ~ (tool | tojson) }}{% endfor %}
{{- '\\n</tools></s>\\n' }}
{%- elif messages[0].role == 'system' %}{{ '<s>system\\n' + messages[0].content + '</s>\\n' }}
{%- endif %}
{%- for message in messages %}
  {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<s>' + message.role + '\\n' + message.content + '</s>\\n' }}
  {%- elif message.role == 'assistant' %}
{{- '<s>assistant' }}{% if message.content %}{{ '\\n' + message.content }}{% endif %}
    {%- for call in message.tool_calls if message.tool_calls is defined %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
{{- call.function.arguments | tojson }}{{ '}\\n</tool_call>' }}
    {%- endfor %}
{{- '</s>\\n' }}
  {%- elif message.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<s>user' }}{% endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '</s>\\n' }}{% endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}
"""

DATED_TEMPLATE = """\
{{- bos_token }}
{%- set date_string = strftime_now("%Y") %}
{%- if messages[0]['role'] == 'system' %}
  {%- set system_message = messages[0]['content'] | trim %}{% set messages = messages[1:] %}
{%- else %}{% set system_message = '' %}{% endif %}
{{- 'system (' + date_string + ')\\n' }}
{%- if tools is not none %}{{ 'Tools:\\n' }}
  {%- for t in tools %}{{ t | tojson(indent=4) }}{{ '\\n\\n' }}{% endfor %}
{%- endif %}
{{- system_message }}{{ eos_token }}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
  {%- if message.role not in ['user', 'assistant', 'tool'] %}
    {{- raise_exception('Unknown role: ' ~ message.role) }}
  {%- endif %}
  {%- set ns.turns = ns.turns + 1 %}
  {{- message['role'] ~ ' #' ~ ns.turns ~ ': ' ~ message['content'] | trim ~ eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}{{ 'assistant:' }}{% endif %}
"""

PARTS_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
  {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}
{%- else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}
{%- for message in loop_messages %}
  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
    {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
  {%- endif %}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
  {{- '<s>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
  {%- if message['content'] is string %}{{ message['content'] | trim }}
  {%- else %}{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}
  {%- endif %}
  {{- '</s>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<s>model\\n' }}{% endif %}
"""

MACRO_TEMPLATE = """\
{%- macro turn(role) %}[{{ role | upper }}] {{ caller() }}{% endmacro %}
{%- set roles = messages | map(attribute='role') | unique | list %}
{%- set counts = dict(user=messages | selectattr('role', 'equalto', 'user') | list | length) %}
{{- 'roles: %s, users: %d' | format(roles | join('/'), counts.user) }}
{%- for message in messages %}
  {%- set body %}{{ message.content | replace('\\n', ' ') | truncate(40) }}{% endset %}
  {%- call turn(message.role) %}{{ body }} {{ loop.cycle('odd', 'even') }}{% endcall %}
  {% generation %}{{ '<' ~ loop.index ~ '>' if message.role == 'assistant' }}{% endgeneration %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '{}:'.format('assistant') }}{% endif %}
"""

TEMPLATES = {
    "tools": TOOLS_TEMPLATE,
    "dated": DATED_TEMPLATE,
    "parts": PARTS_TEMPLATE,
    "macros": MACRO_TEMPLATE,
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city <b>now</b>.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
CONVERSATIONS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "user", "content": "Hi there"}], None),
    (
        [
            {"role": "system", "content": " Be brief. "},
            {"role": "user", "content": "What's 2+2?\nThink."},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3? 🙂"},
        ],
        None,
    ),
    (
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]},
            {"role": "tool", "content": '{"temp": 4}', "tool_call_id": "a"},
            {"role": "tool", "content": '{"temp": 5}', "tool_call_id": "b"},
            {"role": "user", "content": "Thanks"},
        ],
        [WEATHER],
    ),
    ([{"role": "user", "content": [{"type": "text", "text": " parts "}]}], None),
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return train_tiny_tokenizer()


def transformers_text(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    conversation: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
) -> str | Exception:
    try:
        return str(
            tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        )
    except Exception as exc:
        return exc


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_a_conversation_renders_to_the_text_transformers_renders(
    tokenizer: PreTrainedTokenizerBase, name: str, index: int, add_generation_prompt: bool
) -> None:
    template = TEMPLATES[name]
    conversation, tools = CONVERSATIONS[index]
    expected = transformers_text(tokenizer, template, conversation, tools, add_generation_prompt)
    if isinstance(expected, Exception):  # the template refuses this conversation
        with pytest.raises(ChatTemplateError, match=re.escape(str(expected))):
            render_chat(tokenizer, conversation, add_generation_prompt, template, tools)
        return
    text = render_chat(tokenizer, conversation, add_generation_prompt, template, tools)
    assert text == expected


@pytest.mark.parametrize("name", TEMPLATES)
def test_typical_templates_pass_the_load_check(
    tokenizer: PreTrainedTokenizerBase, name: str
) -> None:
    check_chat_template(tokenizer, TEMPLATES[name])


@pytest.mark.slow
def test_the_shipped_templates_pass_the_load_check_with_room_to_spare() -> None:
    try:
        smollm2 = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    except ModelLoadError as exc:
        pytest.skip(f"SmolLM2 is not installed: {exc}")
    # The largest conversation the server takes (512 messages, about its 1 MiB body
    # limit) renders in a tenth of the default work, half its size, a second.
    defaults = TemplateLimits()
    tight = TemplateLimits(
        max_steps=defaults.max_steps // 10, max_chars=defaults.max_chars // 2, max_seconds=1.0
    )
    conversation = [
        {"role": "user" if index % 2 == 0 else "assistant", "content": "word " * 400}
        for index in range(512)
    ]
    tiny = train_tiny_tokenizer()
    check_chat_template(smollm2, limits=tight)
    render_chat(smollm2, conversation, limits=tight)
    for template in TEMPLATES.values():
        check_chat_template(tiny, template, tight)
        render_chat(tiny, conversation, chat_template=template, limits=tight)


NESTED_RANGES = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
# Fine on short messages; past the work limit on a long one.
PER_CHARACTER = (
    "{% for m in messages %}{% for c in m.content %}{% for d in m.content %}"
    "{% endfor %}{% endfor %}{{ m.content }}{% endfor %}"
)


def test_a_template_past_its_limits_on_a_sample_conversation_is_refused(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    with pytest.raises(ChatTemplateError, match="steps") as caught:
        check_chat_template(tokenizer, NESTED_RANGES)
    assert caught.value.limit == "steps" and caught.value.param == "chat_template"
    with pytest.raises(ChatTemplateError, match="1000000000") as caught:
        check_chat_template(tokenizer, "{% if tools %}{{ 'x' * 1000000000 }}{% endif %}")
    assert caught.value.limit == "chars"
    with pytest.raises(ChatTemplateError, match="sandbox") as caught:
        check_chat_template(tokenizer, "{{ messages.append(1) }}")
    assert caught.value.forbidden
    with pytest.raises(ChatTemplateError):
        install_chat_template(tokenizer, NESTED_RANGES)
    assert tokenizer.chat_template != NESTED_RANGES


def test_a_template_that_only_refuses_some_conversations_is_not_refused_at_load(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    check_chat_template(tokenizer, "{{ raise_exception('no system messages') }}")
    check_chat_template(tokenizer, "{{ 2.0 ** 100000 }}")  # an OverflowError every time
    check_chat_template(tokenizer, "{% for %}")  # not Jinja: each request says so
    check_chat_template(tokenizer, PER_CHARACTER)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ raise_exception('roles must alternate') }}", "refused the conversation: roles must"),
        ("{{ 2.0 ** 100000 }}", "OverflowError"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
        ("{{ messages.append(1) }}", "sandbox forbids"),
        ("{{ messages|length // 0 }}", "ZeroDivisionError"),
        ("{% for %}", "not valid Jinja"),
        (PER_CHARACTER, "went past its limits"),
    ],
)
def test_every_template_failure_is_a_chat_template_error(
    tokenizer: PreTrainedTokenizerBase, template: str, message: str
) -> None:
    conversation = [{"role": "user", "content": "x" * 3000}]
    with pytest.raises(ChatTemplateError, match=message) as caught:
        encode_chat(tokenizer, conversation, chat_template=template)
    assert "chat template" in caught.value.message


def test_a_model_file_whose_template_goes_past_its_limits_is_refused_at_load(
    tmp_path: Path,
) -> None:
    path = tmp_path / "hostile.gguf"
    write_gguf(path, with_tiny_tokenizer(TinySpec(), NESTED_RANGES))
    with pytest.raises(ModelLoadError, match="chat template went past its limits") as caught:
        load_tokenizer(resolve_model(str(path)))
    assert caught.value.field == "tokenizer.chat_template"

    hf_tokenizer = train_tiny_tokenizer()
    hf_tokenizer.chat_template = "{{ 'x' * 1000000000 }}"
    folder = save_tiny_model(tmp_path / "hf", "llama", hf_tokenizer)
    with pytest.raises(ModelLoadError, match="1000000000") as caught:
        load_tokenizer(resolve_model(str(folder)))
    assert caught.value.field == "chat_template"


def test_a_model_file_whose_template_fails_only_on_some_requests_loads(tmp_path: Path) -> None:
    path = tmp_path / "fragile.gguf"
    write_gguf(path, with_tiny_tokenizer(TinySpec(), PER_CHARACTER))
    tokenizer = load_tokenizer(resolve_model(str(path)))
    assert encode_chat(tokenizer, [{"role": "user", "content": "short"}])
    with pytest.raises(ChatTemplateError, match="steps"):
        encode_chat(tokenizer, [{"role": "user", "content": "long " * 1000}])
