"""vLLM's chat options against the real server: echo, add_generation_prompt,
continue_final_message, a chat_template and its kwargs per request, documents, the
developer role, names and text parts. The prompt a request renders is read back through
return_token_ids and compared with the text the template should give."""

from __future__ import annotations

import threading
import time

import pytest

from tests.api.conftest import TEMPLATE_TIMEOUT_S, sse_events
from tests.api.test_errors import assert_openai_error

GREEDY = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
CONTINUED = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]


def prompt_ids(http, messages: list[dict], **fields) -> list[int]:
    body = {"messages": messages, **GREEDY, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["prompt_token_ids"]


def text_ids(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_continue_final_message_leaves_the_last_message_open(http):
    rendered = prompt_ids(http, CONTINUED, add_generation_prompt=False, continue_final_message=True)
    expected = "<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\nThe color is"
    assert rendered == text_ids(http, expected)
    closed = prompt_ids(http, CONTINUED, add_generation_prompt=False)
    assert closed == text_ids(http, expected + "<|im_end|>\n")
    both = {"messages": CONTINUED, "add_generation_prompt": True, "continue_final_message": True}
    assert_openai_error(http.post("/v1/chat/completions", json=both), 400, param="continue_final_message")


def test_echo_prefixes_the_continued_message_whole_and_streamed(http):
    body = {"messages": CONTINUED, **GREEDY, "add_generation_prompt": False, "continue_final_message": True}
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()["choices"][0]["message"]
    assert echoed == {"role": "assistant", "content": "The color is" + plain["content"]}
    events = sse_events(http.post("/v1/chat/completions", json={**body, "echo": True, "stream": True}).text)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == echoed["content"]
    # echo only echoes a message of the reply's role: a user's message is not the reply's start
    user_last = http.post("/v1/chat/completions", json={"messages": CONTINUED[:1], **GREEDY, "echo": True}).json()
    assert not user_last["choices"][0]["message"]["content"].startswith("Name a color.")


def test_a_request_chat_template_and_its_kwargs_and_documents(http):
    template = ("{{ greeting }}|{% for d in documents %}[{{ d['text'] }}]{% endfor %}"
                "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}")
    messages = [{"role": "user", "content": "hi"}]
    rendered = prompt_ids(http, messages, chat_template=template, chat_template_kwargs={"greeting": "Yo"},
                          documents=[{"title": "t", "text": "the sun"}])
    assert rendered == text_ids(http, "Yo|[the sun]user:hi;")
    bad = {"messages": messages, "chat_template": template, "chat_template_kwargs": {"add_generation_prompt": 1}}
    assert_openai_error(http.post("/v1/chat/completions", json=bad), 400, param="chat_template_kwargs")
    broken = {"messages": messages, "chat_template": "{% for m in messages %}"}
    assert_openai_error(http.post("/v1/chat/completions", json=broken), 400, param="messages")


# three nested loops: Jinja's sandbox allows them, and they would run for days
SLOW_TEMPLATE = ("{% for a in range(99999) %}{% for b in range(99999) %}{% for c in range(99999) %}"
                 "{% endfor %}{% endfor %}{% endfor %}")


def test_a_template_past_the_time_limit_is_a_400_and_the_others_are_served(http):
    messages = [{"role": "user", "content": "hi"}]
    plain: dict = {}

    def send_plain() -> None:
        time.sleep(0.3)  # while the slow template renders
        plain["response"] = http.post("/v1/chat/completions", json={"messages": messages, **GREEDY})

    sender = threading.Thread(target=send_plain)
    sender.start()
    start = time.monotonic()
    slow = http.post("/v1/chat/completions", json={"messages": messages, **GREEDY, "chat_template": SLOW_TEMPLATE})
    error = assert_openai_error(slow, 400, param="chat_template")
    assert "--chat-template-timeout" in error["message"]
    assert time.monotonic() - start < TEMPLATE_TIMEOUT_S + 10
    sender.join(30)
    # the plain request waited at most for the slow one's limit (the input processor keeps order)
    assert plain["response"].status_code == 200, plain["response"].text
    # /tokenize renders in the API's process, under the same limit
    tokenized = http.post("/tokenize", json={"messages": messages, "chat_template": SLOW_TEMPLATE})
    assert_openai_error(tokenized, 400, param="chat_template")
    assert http.post("/v1/chat/completions", json={"messages": messages, **GREEDY}).status_code == 200


def test_developer_role_is_the_system_role_and_names_reach_the_template(http):
    as_system = prompt_ids(http, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    as_developer = prompt_ids(http, [{"role": "developer", "content": "Be brief."},
                                     {"role": "user", "content": "hi"}])
    assert as_developer == as_system
    template = "{% for m in messages %}{{ m.get('name', '-') }}>{{ m['content'] }}{% endfor %}"
    named = prompt_ids(http, [{"role": "user", "content": "hi", "name": "ann"}, {"role": "user", "content": "yo"}],
                       chat_template=template)
    assert named == text_ids(http, "ann>hi->yo")


def test_text_parts_join_with_newlines(http):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert prompt_ids(http, [{"role": "user", "content": parts}]) == \
        prompt_ids(http, [{"role": "user", "content": "Hello\nworld"}])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_tool_choices_that_need_tools_are_refused(http, tool_choice):
    body = {"messages": CONTINUED[:1], "tool_choice": tool_choice}
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param="tool_choice")
