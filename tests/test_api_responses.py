"""The Responses API (POST /v1/responses) through the real server, driven by the real `openai` client.

On the tiny random model (test_server's server, hermes and qwen3 parsers): greedy outputs equal the offline
engine's on the chat template's rendering of the same conversation (instructions, messages sent back with
their parts, function calls and their outputs), seeded outputs and logprobs equal chat completions'; the
streamed events, which the client's own stream helper checks for order and identity, add up to the
non-streamed response; max_output_tokens makes a response incomplete; refused options get a 400 naming the
field. On the scripted model (test_server_tool_path's) reasoning and a function call come back as items.
"""
from __future__ import annotations

import json
import time

import pytest

from .test_server import API_KEY, MODEL, greedy, llm, metric, model, serving  # noqa: F401 (fixtures)
from .test_server_tool_path import CALL, TOOLS, scripted_server  # noqa: F401 (fixture)

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

FLAT_TOOLS = [dict(t["function"], type="function") for t in TOOLS]  # the Responses API's tools
LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}


# renders what the tiny model's own template leaves out: tools, reasoning, tool calls and their results
TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['id'] }} {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] }}</tool_call>{% endfor %}"
    "{% if m.get('tool_call_id') %} ({{ m['tool_call_id'] }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model):  # noqa: F811
    yield from serving(tmp_path_factory.mktemp("server") / "server.log", "--model", model, "--tool-call-parser",
                       "hermes", "--reasoning-parser", "qwen3", "--chat-template", TEMPLATE, "--responses-store-size",
                       "4", "--enable-prompt-tokens-details", api_key=API_KEY)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def rendered(llm, messages: list[dict], tools=None) -> list[int]:  # noqa: F811
    text = llm.tokenizer.apply_chat_template(messages, tools=tools, chat_template=TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def without_ids(output: list) -> list[dict]:
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k not in ("id", "call_id")}
            for item in output]


def without_logprobs(output: list) -> list[dict]:
    items = without_ids(output)
    for item in items:
        for part in item["content"]:
            part["logprobs"] = [(lp["token"], [t["token"] for t in lp["top_logprobs"]]) for lp in part["logprobs"]]
    return items


def logprob_values(output: list) -> list[float]:
    return [lp.logprob for item in output for part in item.content for lp in part.logprobs]


def test_greedy_output_equals_offline_on_the_rendered_conversation(client, llm):  # noqa: F811
    r = client.responses.create(model=MODEL, instructions="You write Python.", input="Sort a list.",
                                max_output_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    [ref] = llm.generate([rendered(llm, messages)], greedy(16))
    assert r.output_text == ref.text and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(ref.prompt_token_ids), 16)
    assert r.usage.total_tokens == r.usage.input_tokens + 16 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.store and r.model == MODEL and r.id.startswith("resp_")  # (this server keeps responses)


def test_a_conversation_sent_back_renders_as_chat_messages(client, llm):  # noqa: F811
    """Input items as a client sends a previous turn back: the developer role, text parts with annotations,
    a reasoning item, a function call and its output."""
    items = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                    "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": json.dumps({"city": "Paris"}), "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "It is sunny.", "annotations": [], "logprobs": []}]},
        {"role": "user", "content": "And tomorrow?"},
    ]
    messages = [
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "And tomorrow?"},
    ]
    r = client.responses.create(model=MODEL, input=items, tools=FLAT_TOOLS, tool_choice="none", max_output_tokens=12,
                                temperature=0, extra_body={"ignore_eos": True})
    prompt = rendered(llm, messages, TOOLS)
    [ref] = llm.generate([prompt], greedy(12))
    assert r.usage.input_tokens == len(prompt) and r.output_text == ref.text


def test_seeded_output_and_logprobs_equal_chat(client):
    for seed in (None, 7):
        sampling = {"temperature": 0.9 if seed else 0.0}
        r = client.responses.create(model=MODEL, input="Count to five.", max_output_tokens=10, **sampling, **LOGPROBS,
                                    extra_body={"top_k": 20, "seed": seed})
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
                                              max_tokens=10, logprobs=True, top_logprobs=2, extra_body={"top_k": 20},
                                              seed=seed, **sampling)
        assert r.output_text == chat.choices[0].message.content
        ours = r.output[0].content[0].logprobs
        theirs = chat.choices[0].logprobs.content
        assert [(lp.token, [t.token for t in lp.top_logprobs]) for lp in ours] == [
            (lp.token, [t.token for t in lp.top_logprobs]) for lp in theirs]
        assert [lp.logprob for lp in ours] == pytest.approx([lp.logprob for lp in theirs], abs=1e-5)
        assert len(ours) == r.usage.output_tokens


def test_streamed_events_add_up_to_the_response(client):
    kw = dict(model=MODEL, input="Write a loop.", max_output_tokens=14, temperature=0,
              extra_body={"ignore_eos": True, **LOGPROBS})
    events = list(client.responses.create(stream=True, **kw))  # the stream helper wants response.completed
    whole = client.responses.create(**kw)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added"]
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text
    assert sum(len(e.logprobs) for e in deltas) == whole.usage.output_tokens == 14
    streamed = events[-1].response.output
    assert without_logprobs(streamed) == without_logprobs(whole.output)  # (the second ran on a cached prefix)
    assert logprob_values(streamed) == pytest.approx(logprob_values(whole.output), abs=1e-5)
    usage = events[-1].response.usage
    assert (usage.input_tokens, usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)


@pytest.mark.parametrize("body,param,words", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0", "only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content",
     "input_image"),
    ({"input": [{"type": "computer_call"}]}, "input.0", "type must be one of"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id", "required"),
    ({"input": "x", "background": True, "store": False}, "background", "read from the store"),
    ({"input": "x", "background": True, "stream": True}, "stream", "not streamed"),
    ({"input": ""}, "input", "empty"),
    ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens", "max_output_tokens 100000"),
    ({"input": "x", "tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "not in tools"),
])
def test_refused_requests_name_the_field(server, body, param, words):  # noqa: F811
    r = httpx.post(server.url + "/v1/responses", json=dict(body, model=MODEL), headers=server.headers, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_truncation_auto_drops_the_oldest_turns_that_do_not_fit(server, client, llm):  # noqa: F811
    """OpenAI's truncation 'auto': where the conversation would not fit max_model_len (1024) with room for
    max_output_tokens, its oldest whole turns are dropped (the instructions and the last message stay), as few
    as fit; the answer is the offline engine's greedy output on what is left. 'disabled' refuses the same."""
    turns = [{"role": role, "content": f"{role} turn {i}: " + " ".join(f"w{i}x{j}" for j in range(40))}
             for i in range(6) for role in ("user", "assistant")]
    conversation = turns + [{"role": "user", "content": "the question"}]
    system = [{"role": "system", "content": "be brief"}]
    body = dict(model=MODEL, instructions="be brief", input=conversation, max_output_tokens=8, temperature=0)
    assert len(rendered(llm, system + conversation)) > 1024 - 8
    kept = next(conversation[d:] for d in range(0, len(conversation), 2)
                if len(rendered(llm, system + conversation[d:])) <= 1024 - 8)  # whole turns from the oldest
    assert 1 < len(kept) < len(conversation)
    [want] = llm.generate([rendered(llm, system + kept)], greedy(8))
    response = client.responses.create(**body, truncation="auto")
    assert response.truncation == "auto" and response.output_text == want.text
    assert response.usage.input_tokens == len(rendered(llm, system + kept))
    r = httpx.post(server.url + "/v1/responses", json=dict(body, truncation="disabled"), headers=server.headers,
                   timeout=30)
    assert r.status_code == 400, r.text


def test_cached_input_tokens_are_the_prefix_cache_hits_within_a_cache_salt(server, client):  # noqa: F811
    text = " ".join(f"item {i}" for i in range(120))  # a prompt of several KV blocks, new to the cache
    hits = lambda: metric(httpx.get(server.url + "/metrics").text, "specserve:prefix_cache_hits_total")  # noqa: E731
    before = hits()
    first, second = (client.responses.create(model=MODEL, input=text, max_output_tokens=2) for _ in range(2))
    block = server.info()["config"]["block_size"]
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens_details.cached_tokens == (second.usage.input_tokens - 1) // block * block > 0
    assert hits() - before == second.usage.input_tokens_details.cached_tokens
    salted = [client.responses.create(model=MODEL, input=text, max_output_tokens=2, extra_body={"cache_salt": salt})
              for salt in ("user-1", "user-2", "user-1")]  # vLLM's cache_salt: KV shared within a salt only
    assert [r.usage.input_tokens_details.cached_tokens for r in salted] == [0, 0, second.usage.input_tokens_details
                                                                                  .cached_tokens]


def test_chat_usage_details_count_each_prompt_once(client):
    """--enable-prompt-tokens-details (vLLM's flag, on this module's server): chat's usage names the prompt tokens
    found in the prefix cache, a prompt's first choice's, streamed or not."""
    messages = [{"role": "user", "content": " ".join(f"word {i}" for i in range(100))}]
    kw = dict(model=MODEL, messages=messages, max_tokens=2, n=2)
    first, second = (client.chat.completions.create(**kw) for _ in range(2))
    block = 16
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # its second choice's hit is not counted again
    want = (second.usage.prompt_tokens - 1) // block * block
    assert second.usage.prompt_tokens_details.cached_tokens == want > 0
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == want


def test_run_time_lora_routes_need_their_flag(server):  # noqa: F811
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"},
                   headers=server.headers, timeout=30)
    assert r.status_code == 404  # served with --allow-runtime-lora-updating only (tests/test_lora.py)


def test_stored_responses_continue_their_conversation(server, client, llm):  # noqa: F811
    """--responses-store-size 4: a response continued by previous_response_id renders the stored conversation
    (its instructions not carried over, as in OpenAI's API) then the new input; stored responses can be retrieved
    and deleted; `store: false` keeps one out; the oldest is dropped first."""
    kw = dict(model=MODEL, max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    first = client.responses.create(instructions="Be brief.", input="Hi.", **kw)
    assert first.store and client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(previous_response_id=first.id, input="More.", **kw)
    messages = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "More."}]
    prompt = rendered(llm, messages)
    [ref] = llm.generate([prompt], greedy(8))
    assert (second.output_text, second.usage.input_tokens) == (ref.text, len(prompt))
    assert second.previous_response_id == first.id
    unstored = client.responses.create(input="Hi.", store=False, **kw)
    assert not unstored.store
    for gone in (unstored.id, "resp_none"):
        with pytest.raises(openai.NotFoundError, match="no response"):
            client.responses.retrieve(gone)
    r = httpx.delete(f"{server.url}/v1/responses/{first.id}", headers=server.headers, timeout=30)
    assert r.json() == {"id": first.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="previous response"):
        client.responses.create(previous_response_id=first.id, input="More.", **kw)
    later = [client.responses.create(input=f"Turn {i}.", **kw).id for i in range(4)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)  # the oldest of five went
    assert client.responses.retrieve(later[0]).id == later[0]


def test_background_responses_are_polled_to_the_end_or_cancelled(server, client, llm):  # noqa: F811
    """background: the answer is the queued response; GET reads it in progress, then the finished response, whose
    output is the offline engine's greedy one; a running one cancelled is stored as cancelled, without output,
    and cannot be cancelled again."""
    kw = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})
    queued = client.responses.create(input="Hi.", max_output_tokens=8, background=True, **kw)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    done = poll(client, queued.id, lambda r: r.status not in ("queued", "in_progress"))
    [ref] = llm.generate([rendered(llm, [{"role": "user", "content": "Hi."}])], greedy(8))
    assert (done.status, done.output_text, done.background) == ("incomplete", ref.text, True)
    running = client.responses.create(input="Hi.", max_output_tokens=900, background=True, **kw)
    poll(client, running.id, lambda r: r.status == "in_progress")
    cancelled = client.responses.cancel(running.id)
    assert (cancelled.status, cancelled.output) == ("cancelled", [])
    assert client.responses.retrieve(running.id).status == "cancelled"
    r = httpx.post(f"{server.url}/v1/responses/{running.id}/cancel", headers=server.headers, timeout=30)
    assert r.status_code == 400 and "no background response in progress" in r.json()["error"]["message"]
    assert server.info()["num_requests_in_flight"] == 0


def poll(client, response_id: str, until, timeout: float = 60):
    """The stored response once `until` holds for it."""
    deadline = time.monotonic() + timeout
    while not until(response := client.responses.retrieve(response_id)):
        assert time.monotonic() < deadline, response.status
        time.sleep(0.02)
    return response


def test_item_references_stand_for_stored_output_items(server, client, llm):  # noqa: F811
    """An item_reference renders as the stored output item it names, sent inline; an unknown or deleted one is a 404
    naming the input item."""
    kw = dict(model=MODEL, max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    first = client.responses.create(input="Hi.", **kw)
    [message] = first.output
    by_reference = client.responses.create(input=[{"role": "user", "content": "Hi."},
                                                  {"type": "item_reference", "id": message.id},
                                                  {"role": "user", "content": "More."}], **kw)
    prompt = rendered(llm, [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": first.output_text},
                            {"role": "user", "content": "More."}])
    [ref] = llm.generate([prompt], greedy(8))
    assert (by_reference.output_text, by_reference.usage.input_tokens) == (ref.text, len(prompt))
    httpx.delete(f"{server.url}/v1/responses/{first.id}", headers=server.headers, timeout=30)
    for gone in (message.id, "msg_none"):
        r = httpx.post(server.url + "/v1/responses", headers=server.headers, timeout=30, json=dict(
            model=MODEL, input=[{"type": "item_reference", "id": gone}, {"role": "user", "content": "x"}]))
        assert r.status_code == 404 and r.json()["error"]["param"] == "input.0.id", r.text
        assert f"no stored item {gone!r}" in r.json()["error"]["message"]


def test_a_stored_responses_input_items_are_listed(client):
    """OpenAI's GET /v1/responses/{id}/input_items: the request's input items with ids, newest first by default,
    paged with limit and after."""
    kw = dict(model=MODEL, max_output_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    r = client.responses.create(input=[{"role": "user", "content": "Hi."},
                                       {"role": "assistant", "content": "Hello."},
                                       {"type": "message", "role": "user", "content": [
                                           {"type": "input_text", "text": "More."}]}], **kw)
    items = client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].type, i.content[0].text) for i in items.data] == [
        ("message", "user", "input_text", "More."), ("message", "assistant", "output_text", "Hello."),
        ("message", "user", "input_text", "Hi.")]
    assert all(i.id.startswith("msg_") for i in items.data) and len({i.id for i in items.data}) == 3
    oldest = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in oldest.data] == ["Hi.", "Hello."] and oldest.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=oldest.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["More."] and not rest.has_more
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_none")


def test_reasoning_and_a_function_call_come_back_as_items(scripted_server):  # noqa: F811
    client = scripted_server.client()
    kw = dict(model="tiny", input="weather Paris", tools=FLAT_TOOLS, temperature=0, max_output_tokens=20)
    r = client.responses.create(**kw)
    assert r.status == "completed" and [item.type for item in r.output] == ["reasoning", "function_call"]
    reasoning, call = r.output
    assert reasoning.content[0].text.strip() == "The user wants the weather." and reasoning.summary == []
    assert call.name == "get_weather" and json.loads(call.arguments) == CALL["arguments"]
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert r.usage.output_tokens_details.reasoning_tokens == 3  # <think>, the sentence, </think>
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert without_ids(final.output) == without_ids(r.output)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (done.name, done.arguments) == ("get_weather", call.arguments)
    cut = client.responses.create(**dict(kw, max_output_tokens=2))  # <think> and the sentence
    assert cut.status == "incomplete" and [(i.type, i.status) for i in cut.output] == [("reasoning", "incomplete")]
    assert cut.usage.output_tokens_details.reasoning_tokens == 2


def test_structured_output_and_a_forced_function_call(client):
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "s": {"enum": ["a", "b"]}},
              "required": ["n", "s"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Some JSON.", max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    tools = [{"type": "function", "name": "get_weather", "parameters": city}]  # (bounded: a random model rambles)
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, max_output_tokens=60,
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), city)


def test_a_stored_response_continues_as_the_chat_messages_of_its_items():
    """A worked example without a server: an output of reasoning and a tool call is stored as the assistant message
    that holds them, and a request continuing it with the call's output renders as chat would."""
    from specserve import SamplingParams
    from specserve.engine.outputs import RequestOutput
    from specserve.server.errors import APIError
    from specserve.server.formatting import Envelope, TokenText
    from specserve.server.protocol_responses import ResponsesRequest
    from specserve.server.response_store import ResponseStore, StoredResponse
    from specserve.server.responses_api import ResponseFormatter, referenced

    store = ResponseStore(2)
    req = ResponsesRequest.model_validate({"input": "Weather in Paris?", "instructions": "Be brief.",
                                           "tools": FLAT_TOOLS})
    fmt = ResponseFormatter(Envelope("resp_1", "m"), TokenText(None), False, reasoning_parser="qwen3", tools="hermes",
                            schemas=None, req=req, params=SamplingParams(), tokenizer=None, store=store,
                            conversation=req.conversation())
    text = '<think>Look it up.</think><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    body = fmt.response(RequestOutput("r", [1, 2], [3, 4], text, [3, 4], text, True, "stop"))
    assert [item["type"] for item in body["output"]] == ["reasoning", "function_call"]
    call_id = body["output"][1]["call_id"]
    [user, assistant] = store.get("resp_1").conversation
    assert user == {"role": "user", "content": "Weather in Paris?"}
    assert assistant == {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    follow = ResponsesRequest.model_validate({"previous_response_id": "resp_1", "input": [
        {"type": "function_call_output", "call_id": call_id, "output": "sunny"}]})
    assert follow.to_chat(store.get("resp_1").conversation).template_messages()[-3:] == [
        {"role": "user", "content": "Weather in Paris?"}, dict(assistant),
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"}]
    # the same items by reference: the user's message, then the stored reasoning and call, then the call's output
    by_reference = ResponsesRequest.model_validate({"input": [{"role": "user", "content": "Weather in Paris?"}] + [
        {"type": "item_reference", "id": item["id"]} for item in body["output"]] + [
        {"type": "function_call_output", "call_id": call_id, "output": "sunny"}]})
    assert referenced(store, by_reference).to_chat().template_messages() == \
        follow.to_chat(store.get("resp_1").conversation).template_messages()
    for k in (3, 4):  # two more responses: the first is dropped, and its items with it
        store.put(StoredResponse({"id": f"resp_{k}", "output": [{"id": f"msg_{k}", "type": "message"}]}, []))
    assert store.get("resp_1") is None and store.item(body["output"][1]["id"]) is None
    assert store.item("msg_4") == {"id": "msg_4", "type": "message"}
    with pytest.raises(APIError, match="no stored item"):
        referenced(store, by_reference)
    with pytest.raises(APIError, match="this server stores none"):
        referenced(ResponseStore(0), by_reference)

