"""OpenAI tools through the real uvicorn and the official `openai` client: constrained calls
(tool_choice required / a named function), "auto" through a template that takes tools,
tool history rendered, bad definitions refused."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from app.server.runner import ServerThread
from app.server.tools import HERMES, LLAMA3, MISTRAL, for_template, may_become_call, parse_template_calls
from hostile_cases import demo_copy

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                 "maximum": 14}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# What the demo's 256 positions hold beside a template's tool prompt.
SMALL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}

# A Hermes/Qwen-style template (the shape of Qwen2.5's): tools in a system turn, calls in <tool_call> tags.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{%- for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def _serve(engine):
    return ServerThread(lambda: engine, lambda: "demo", port=0, max_waiting=16).start()


@pytest.fixture(scope="module")
def hermes_engine(tmp_path_factory):
    from engine import Engine

    folder = demo_copy(tmp_path_factory.mktemp("hermes") / "demo-hermes")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Engine.load(folder, mode="dense")


@pytest.fixture(scope="module")
def client(engine):
    srv = _serve(engine)
    yield openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)
    srv.stop()


@pytest.fixture(scope="module")
def hermes_client(hermes_engine):
    srv = _serve(hermes_engine)
    yield openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)
    srv.stop()


def _check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("temperature, seed", [(0, None), (1.0, 3), (1.4, 4)])
def test_required_returns_calls_that_match_the_functions_schemas(client, temperature, seed):
    resp = client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                          max_tokens=120, temperature=temperature, seed=seed)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls)


def test_a_named_function_is_the_one_called_and_parallel_false_gives_one_call(client):
    resp = client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER, TIME], max_tokens=120,
                                          tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = resp.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    _check_calls(calls)
    single = client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER, TIME], max_tokens=120,
                                            tool_choice="required", parallel_tool_calls=False, temperature=0)
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_streamed_required_call_arrives_as_tool_call_deltas(client):
    stream = client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER], tool_choice="required",
                                            max_tokens=120, temperature=0.9, seed=2, stream=True)
    chunks = list(stream)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and all(d.function.name == "get_weather" for d in deltas)
    jsonschema.validate(json.loads(deltas[0].function.arguments), SCHEMAS["get_weather"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_auto_is_refused_for_a_template_that_takes_no_tools(client):
    for kw in ({"tool_choice": "auto"}, {}):  # OpenAI's default with tools is auto
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER], max_tokens=4, **kw)
        assert err.value.body["param"] == "tool_choice" and "takes none" in err.value.body["message"]
    # tool_choice none: an answer in words, as without tools
    resp = client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=4)
    assert resp.choices[0].message.tool_calls is None


def test_auto_shows_the_template_the_tools_and_answers_in_words_when_the_model_does(hermes_client, hermes_engine):
    resp = hermes_client.chat.completions.create(model="demo", messages=ASK, tools=[SMALL], tool_choice="auto",
                                                 max_tokens=12, temperature=0)
    with_tools = hermes_engine.encode_prompt(ASK, tools=[SMALL])
    assert resp.usage.prompt_tokens == len(with_tools) > len(hermes_engine.encode_prompt(ASK))
    assert "get_weather" in hermes_engine.tokenizer.render_chat(ASK, tools=[SMALL])
    choice = resp.choices[0]  # the demo writes prose: content, no calls
    assert choice.message.tool_calls is None and choice.message.content and choice.finish_reason != "tool_calls"
    streamed = hermes_client.chat.completions.create(model="demo", messages=ASK, tools=[SMALL], max_tokens=12,
                                                     temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == choice.message.content


HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": "{\"city\": \"Paris\", \"unit\": \"C\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
]


def test_tool_history_is_accepted_and_rendered(client, engine, hermes_client, hermes_engine):
    from app.server.protocol import parse_chat

    parsed = parse_chat({"messages": HISTORY}).prompt
    resp = hermes_client.chat.completions.create(model="demo", messages=HISTORY, tools=[SMALL], max_tokens=4)
    text = hermes_engine.tokenizer.render_chat(parsed, tools=[SMALL])
    assert "<tool_response>\n{\"temp\": 21}" in text and '"arguments": {"city": "Paris", "unit": "C"}' in text
    assert resp.usage.prompt_tokens == len(hermes_engine.encode_prompt(parsed, tools=[SMALL]))
    # A template with no tools reads the call and its result as plain turns.
    plain = client.chat.completions.create(model="demo", messages=HISTORY, max_tokens=4)
    shown = for_template(parsed, tool_aware=False)
    assert "get_weather" in shown[1]["content"] and shown[2] == {
        "role": "user", "content": "Result of tool call call_1: {\"temp\": 21}"}
    assert plain.usage.prompt_tokens == len(engine.encode_prompt(shown))


@pytest.mark.parametrize("tools, param", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"minimum": "x"}}}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "tools[0].function.name"),
    ([{"type": "code_interpreter"}], "tools[0]"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
])
def test_a_bad_tool_definition_is_a_400(client, tools, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=ASK, tools=tools, tool_choice="required", max_tokens=4)
    assert err.value.body["param"] == param


def test_bad_tool_choices_and_history_are_400s(client):
    def refused(**kw):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="demo", max_tokens=4, **kw)
        return err.value.body["param"]

    assert refused(messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}) \
        == "tool_choice"
    assert refused(messages=ASK, tool_choice="required") == "tool_choice"
    assert refused(messages=ASK + [{"role": "tool", "content": "x"}]) == "messages[1].tool_call_id"
    assert refused(messages=[{"role": "user", "content": "x", "tool_calls": []}]) == "messages[0].tool_calls"
    assert refused(messages=ASK, tools=[WEATHER], tool_choice="required",
                   response_format={"type": "json_object"}) == "response_format"


def test_the_template_formats_are_parsed():
    names = ["get_weather"]
    content, calls = parse_template_calls(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', HERMES, names)
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    _, calls = parse_template_calls('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"a": 1}}]', MISTRAL, names)
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    _, calls = parse_template_calls('{"name": "get_weather", "parameters": {"x": 2}}', LLAMA3, names)
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 2}
    # Prose, a call that does not parse, or a function that was not offered: content as written.
    for text in ("It is sunny.", "<tool_call>{broken", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'):
        assert parse_template_calls(text, HERMES, names) == (text, [])
    assert may_become_call("<tool", HERMES) and may_become_call(" <tool_call>{", HERMES)
    assert not may_become_call("It", HERMES) and not may_become_call("Sure", LLAMA3)


def _walk(grammar, lark: str, text: str) -> bool:
    """Whether the grammar library takes `text` whole, token by token, and may end there."""
    from engine.runtime.constraints import GrammarSpec

    constraint = grammar.start(GrammarSpec.lark(lark))
    ids = grammar.tokenizer.tokenize_str(text)
    return all(constraint.matcher.consume_token(t) for t in ids) and constraint.matcher.is_accepting()


@pytest.mark.parametrize("parallel", [True, False])
def test_a_strict_function_under_auto_holds_its_calls_to_the_schema(hermes_engine, parallel):
    from app.server.tools import ToolRequest, strict_auto_grammar

    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    req = ToolRequest([strict, TIME], "auto", parallel=parallel, names=["get_weather", "get_time"])
    lark = strict_auto_grammar(req, HERMES)
    grammar = hermes_engine.token_grammar()

    def takes(text):
        return _walk(grammar, lark, text)

    good = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","unit":"C"}}\n</tool_call>'
    assert takes("It is sunny in Oslo.") and takes(good)
    assert not takes(good.replace('"C"', '"K"'))  # outside the strict schema
    assert not takes(good.replace("get_weather", "rm_rf"))  # a function not offered
    assert takes('<tool_call>{"name":"get_time","arguments":{"anything":1}}</tool_call>')  # not strict
    assert takes(good + "\n" + good) == parallel  # parallel_tool_calls false: one call at most
    assert strict_auto_grammar(ToolRequest([WEATHER], "auto", names=["get_weather"]), HERMES) is None


def test_parallel_false_under_auto_returns_at_most_one_call(hermes_client):
    two = ('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>\n'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    assert len(parse_template_calls(two, HERMES, ["get_weather"])[1]) == 2
    assert len(parse_template_calls(two, HERMES, ["get_weather"], single=True)[1]) == 1
    # Through the server: a strict tool's grammar compiles and the answer comes back (the demo writes prose).
    strict = {"type": "function", "function": {**SMALL["function"], "strict": True}}
    resp = hermes_client.chat.completions.create(model="demo", messages=ASK, tools=[strict], tool_choice="auto",
                                                 parallel_tool_calls=False, max_tokens=8, temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_strict_flag_that_is_not_a_boolean_is_a_400(client):
    bad = {"type": "function", "function": {**WEATHER["function"], "strict": "yes"}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=ASK, tools=[bad], tool_choice="required", max_tokens=4)
    assert err.value.body["param"] == "tools[0].function.strict"


def test_strict_auto_grammars_of_the_mistral_and_llama3_formats(hermes_engine):
    from app.server.tools import ToolRequest, strict_auto_grammar

    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    grammar = hermes_engine.token_grammar()
    for fmt, good in ((MISTRAL, '[TOOL_CALLS] [{"name":"get_weather","arguments":{"city":"Oslo","unit":"F"}}]'),
                      (LLAMA3, '{"name":"get_weather","parameters":{"city":"Oslo","unit":"F"}}')):
        lark = strict_auto_grammar(ToolRequest([strict], "auto", names=["get_weather"]), fmt)
        assert _walk(grammar, lark, good) and _walk(grammar, lark, "No call needed.")
        assert not _walk(grammar, lark, good.replace('"F"', '"K"'))
