"""The OpenAI fields past the basics, through the real uvicorn and the official `openai` client
over the embedded demo model: every field a client sends is honoured or refused with a 400
that names it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest


CHAT = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def refused(call, **kw) -> dict:
    """The error body of a request the server must refuse with a 400."""
    with pytest.raises(openai.BadRequestError) as err:
        call(**kw)
    return err.value.body


@pytest.mark.parametrize("field, value", [
    ("store", True), ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("reasoning_effort", "high"), ("web_search_options", {}), ("logprobs", True), ("top_logprobs", 2),
    ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto"), ("verbosity", "low"),
])
def test_a_feature_the_server_lacks_is_refused_by_name(client, field, value):
    body = refused(client.chat.completions.create, model="demo", messages=CHAT, max_tokens=2,
                   extra_body={field: value})
    assert body["param"] == field and field in body["message"]


def test_an_unknown_field_is_refused_by_name(client):
    body = refused(client.chat.completions.create, model="demo", messages=CHAT, max_tokens=2,
                   extra_body={"temprature": 0})
    assert body["param"] == "temprature" and body["code"] == "unknown_field"
    body = refused(client.completions.create, model="demo", prompt="Once", max_tokens=2,
                   extra_body={"messages": CHAT})  # a chat field sent to text completions
    assert body["param"] == "messages"


def test_completion_only_fields_are_refused_unless_default(client):
    assert refused(client.completions.create, model="demo", prompt="Once", echo=True)["param"] == "echo"
    assert refused(client.completions.create, model="demo", prompt="Once", suffix="end")["param"] == "suffix"
    assert refused(client.completions.create, model="demo", prompt="Once", best_of=3)["param"] == "best_of"
    assert client.completions.create(model="demo", prompt="Once", max_tokens=2, best_of=1, echo=False).choices


def test_a_message_field_the_server_does_not_take_is_refused(client):
    messages = [{"role": "user", "content": "hi", "audio": {"id": "a1"}}]
    body = refused(client.chat.completions.create, model="demo", messages=messages, max_tokens=2)
    assert body["param"] == "messages[0].audio"


def test_defaults_and_caller_fields_are_accepted(client):
    resp = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi", "name": "ann"}], max_tokens=2, user="u-1",
        metadata={"k": "v"}, store=False, service_tier="auto", modalities=["text"], parallel_tool_calls=True,
        response_format={"type": "text"}, tools=[], tool_choice="none", presence_penalty=0,
        frequency_penalty=0.0, logit_bias={}, logprobs=False, extra_body={"safety_identifier": "s", "top_k": 1})
    assert resp.choices[0].message.role == "assistant"


def test_a_null_field_counts_as_absent(server):
    body = {"model": "demo", "messages": CHAT, "max_tokens": 2, "tools": None, "response_format": None,
            "audio": None, "temprature": None}
    assert httpx.post(server.url + "/chat/completions", json=body, timeout=60).status_code == 200


def test_penalties_and_logit_bias_are_honoured(client, engine):
    from engine import SamplingParams

    def ask(**kw):
        return client.chat.completions.create(model="demo", messages=CHAT, max_tokens=24, temperature=0,
                                              **kw).choices[0].message.content

    plain = ask()
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"frequency_penalty": -1.5}):
        expected = engine.generate(CHAT, SamplingParams(max_new_tokens=24, temperature=0, **kw)).text
        assert ask(**kw) == expected
    assert ask(presence_penalty=2.0) != plain  # the demo repeats itself: 2.0 changes its answer
    first = engine.generate(CHAT, SamplingParams(max_new_tokens=24, temperature=0)).token_ids
    banned = {str(t): -100 for t in first}
    expected = engine.generate(CHAT, SamplingParams(max_new_tokens=24, temperature=0,
                                                    logit_bias={t: -100 for t in first}))
    assert not set(expected.token_ids) & set(first)
    assert ask(logit_bias=banned) == expected.text


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", "high"),
                                          ("logit_bias", {"x": 1}), ("logit_bias", {"5": 200}),
                                          ("logit_bias", {"99999999": 1})])
def test_bad_penalties_are_400s_naming_the_field(client, field, value):
    body = refused(client.chat.completions.create, model="demo", messages=CHAT, max_tokens=2,
                   extra_body={field: value})
    assert field in body["message"] and body["param"] in (field, None)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "owl"]}, "maxItems": 3},
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age", "pets", "alive"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe the cat as JSON."}]


def _schema_format(schema, name="person"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature, seed", [(0, None), (1.0, 1), (1.0, 2), (1.3, 3)])
def test_json_schema_answers_parse_and_validate(client, temperature, seed):
    import jsonschema

    resp = client.chat.completions.create(model="demo", messages=ASK_PERSON, max_tokens=150, temperature=temperature,
                                          seed=seed, response_format=_schema_format(PERSON))
    value = json.loads(resp.choices[0].message.content)
    jsonschema.validate(value, PERSON)
    assert resp.choices[0].finish_reason == "stop"  # the answer ended where its JSON ended


def test_json_schema_streamed_and_in_text_completions(client):
    import jsonschema

    stream = client.chat.completions.create(model="demo", messages=ASK_PERSON, max_tokens=150, temperature=0.9,
                                            seed=5, stream=True, response_format=_schema_format(PERSON))
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    resp = client.completions.create(model="demo", prompt="The cat:", max_tokens=150, temperature=0,
                                     extra_body={"response_format": _schema_format(PERSON)})
    jsonschema.validate(json.loads(resp.choices[0].text), PERSON)


def test_json_mode_answers_an_object(client):
    for seed in (1, 2):
        resp = client.chat.completions.create(model="demo", messages=ASK_PERSON, max_tokens=200, temperature=0.8,
                                              seed=seed, response_format={"type": "json_object"})
        assert isinstance(json.loads(resp.choices[0].message.content), dict)


@pytest.mark.parametrize("schema, param, words", [
    ({"type": "strin"}, "response_format.json_schema.schema", "not valid JSON Schema"),
    ({"type": "object", "properties": {"a": {"minLength": -1}}}, "response_format.json_schema.schema",
     "not valid JSON Schema"),
    ({"$ref": "#/definitions/nowhere"}, "response_format", "nowhere"),
    ({"type": "string", "pattern": "(unclosed"}, "response_format.json_schema.schema", "regex"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "response_format", "uniqueItems"),
])
def test_a_schema_that_cannot_be_compiled_is_a_400_naming_the_problem(client, schema, param, words):
    body = refused(client.chat.completions.create, model="demo", messages=ASK_PERSON, max_tokens=8,
                   response_format=_schema_format(schema))
    assert body["param"] == param and words in body["message"], body


def test_a_bad_response_format_is_a_400(client):
    for value, param in (({"type": "xml"}, "response_format.type"), ("json", "response_format"),
                         ({"type": "json_schema"}, "response_format.json_schema")):
        assert refused(client.chat.completions.create, model="demo", messages=CHAT, max_tokens=2,
                       extra_body={"response_format": value})["param"] == param


def test_metrics_in_prometheus_format(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        r = httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        out = {}
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    before = scrape()
    whole = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=6, temperature=0)
    streamed = list(client.completions.create(model="demo", prompt="Once", max_tokens=5, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    after = scrape()

    def grew(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    new = whole.usage.completion_tokens + streamed[-1].usage.completion_tokens
    prompt = whole.usage.prompt_tokens + streamed[-1].usage.prompt_tokens
    assert grew("thermocline_generation_tokens_total") == new
    assert grew("thermocline_prompt_tokens_total") == prompt
    assert grew("thermocline_requests_total", (("route", "/v1/chat/completions"), ("status", "200"))) == 1
    assert grew("thermocline_requests_total", (("route", "/v1/completions"), ("status", "200"))) == 1
    assert grew("thermocline_time_to_first_token_seconds_count") == 2
    assert grew("thermocline_decode_tokens_per_second_count") == 2
    assert grew("thermocline_request_duration_seconds_count") == 2
    assert after[("thermocline_queue_depth", ())] == 0


def test_stream_options_are_honoured_or_refused_by_name(client):
    def usage_chunks(**options):
        chunks = list(client.chat.completions.create(model="demo", messages=CHAT, max_tokens=3, stream=True,
                                                     **options))
        return [c.usage for c in chunks if c.usage is not None]

    assert usage_chunks() == [] and usage_chunks(stream_options={"include_usage": False}) == []
    [usage] = usage_chunks(stream_options={"include_usage": True})  # asked for: one, after the answer
    assert usage.completion_tokens == 3
    for options, param in (({"include_usage": True, "continuous_usage_stats": True},
                            "stream_options.continuous_usage_stats"),
                           ({"include_obfuscation": True}, "stream_options.include_obfuscation")):
        body = refused(client.chat.completions.create, model="demo", messages=CHAT, max_tokens=2, stream=True,
                       stream_options=options)
        assert body["param"] == param
    body = refused(client.chat.completions.create, model="demo", messages=CHAT, max_tokens=2,
                   stream_options={"include_usage": True})  # OpenAI's rule: only with stream
    assert body["param"] == "stream_options" and "stream" in body["message"]


def test_an_assistant_refusal_in_the_history_is_what_the_model_reads(client, engine):
    said = "I cannot help with that."
    history = [*CHAT, {"role": "assistant", "content": None, "refusal": said}, {"role": "user", "content": "Why?"}]
    resp = client.chat.completions.create(model="demo", messages=history, max_tokens=1)
    as_content = [*CHAT, {"role": "assistant", "content": said}, {"role": "user", "content": "Why?"}]
    assert resp.usage.prompt_tokens == len(engine.encode_prompt(as_content))
    body = refused(client.chat.completions.create, model="demo", max_tokens=1,
                   messages=[{"role": "user", "content": "hi", "refusal": "no"}])
    assert body["param"] == "messages[0].refusal"


def test_a_grammar_being_built_holds_up_no_other_request(server, client, engine, monkeypatch):
    import threading

    building, release = threading.Event(), threading.Event()
    check = engine.check_grammar

    def slow_check(spec):  # the real compile, held until /health has answered
        building.set()
        release.wait(30)
        return check(spec)

    monkeypatch.setattr(engine, "check_grammar", slow_check)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("r", client.chat.completions.create(
        model="demo", messages=CHAT, max_tokens=8, response_format={"type": "json_object"})))
    worker.start()
    try:
        assert building.wait(30)
        health = httpx.get(server.url.removesuffix("/v1") + "/health", timeout=10)  # hung before: the loop built it
        assert health.status_code == 200
    finally:
        release.set()
        worker.join(60)
    json.loads(result["r"].choices[0].message.content)


def test_concurrent_first_constrained_requests_build_one_token_grammar():
    import threading

    from engine import Engine
    from models_registry.resolve import resolve_model

    fresh = Engine.load(resolve_model("demo"), mode="dense")
    start, got = threading.Barrier(6), []

    def first():
        start.wait()
        got.append(fresh.token_grammar())

    threads = [threading.Thread(target=first) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 6 and all(g is got[0] for g in got)
