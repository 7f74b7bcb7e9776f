"""The OpenAI-compatible server, driven by the official `openai` client over loopback.

One server (`BackgroundServer`: the engine core in its own process, the HTTP server in
a thread of the test process) serves the whole module; the last test
starts a second one and kills its engine core. Every call has a client-side timeout, so
a hang fails the test instead of stalling the suite. The structured-output tests (chapter
15) check what the server returns with `jsonschema` and `re.fullmatch`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The server, its engine-core process and the official client; the GPU image has none of them.
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from benchmarks.structured_outputs import PERSON
from helpers.servers import TIMEOUT_S, ServerThread, stream_completion, wait_until_healthy, wait_until_idle

from nano_v1.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.ch09  # every test talks to a real server

PROMPT = "def fibonacci(n):\n"
# The example's custom logits processor, by name: the engine core imports it in its own process.
LOGITS_PROCESSOR = "examples.offline_inference.logits_processor.custom:DummyLogitsProcessor"
ENGINE_KWARGS = dict(
    max_model_len=1024,
    block_size=16,
    num_gpu_blocks_override=512,
    dtype="float32",
    logits_processors=[LOGITS_PROCESSOR],
)


@pytest.fixture(scope="module")
def server():
    server = ServerThread(**ENGINE_KWARGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert httpx.get(f"{server.base_url}/health", timeout=TIMEOUT_S).status_code == 200


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(prompt=PROMPT, max_tokens=16, temperature=0.0)
    full = client.completions.create(model="demo", **kwargs)
    assert full.usage.completion_tokens == 16 or full.choices[0].finish_reason == "stop"
    assert full.choices[0].text
    texts, reasons = stream_completion(client, **kwargs)
    assert texts == {0: full.choices[0].text}
    assert reasons == {0: full.choices[0].finish_reason}


def test_stop_string_trimmed_streamed_and_not(client):
    kwargs = dict(prompt=PROMPT, max_tokens=16, temperature=0.0)
    text = client.completions.create(model="demo", **kwargs).choices[0].text
    stop = text[5:8]  # three characters from inside the greedy output
    expected = text[: text.index(stop)]
    full = client.completions.create(model="demo", stop=[stop], **kwargs)
    assert full.choices[0].text == expected
    assert full.choices[0].finish_reason == "stop"
    assert stream_completion(client, stop=[stop], **kwargs) == ({0: expected}, {0: "stop"})


def test_vllm_extras_truncate_prompt_tokens_and_vllm_xargs(server, client):
    """vLLM's extras reach the engine: the prompt cut to its last 2 tokens, and `vllm_xargs` as a
    custom logits processor's `extra_args` (only the request that names a target is forced)."""
    kwargs = dict(model="demo", prompt=PROMPT, max_tokens=6, temperature=0.0)
    cut = client.completions.create(extra_body={"truncate_prompt_tokens": 2}, **kwargs)
    assert cut.usage.prompt_tokens == 2
    forced = client.completions.create(extra_body={"vllm_xargs": {"target_token": 7}}, **kwargs)
    sevens = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [7] * 6}, timeout=TIMEOUT_S).json()
    assert forced.choices[0].text == sevens["prompt"]
    assert client.completions.create(**kwargs).choices[0].text != forced.choices[0].text


def test_n2_seeded_stream_equals_non_stream(client):
    kwargs = dict(prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=2, extra_body={"ignore_eos": True})
    full = client.completions.create(model="demo", **kwargs)
    by_index = {c.index: c.text for c in full.choices}
    assert sorted(by_index) == [0, 1] and by_index[0] != by_index[1]
    assert full.usage.completion_tokens == 16
    texts, reasons = stream_completion(client, **kwargs)
    assert texts == by_index and reasons == {0: "length", 1: "length"}


def test_chat_uses_chat_template(server, client):
    messages = [{"role": "user", "content": "write a function"}]
    chat = client.chat.completions.create(model="demo", messages=messages, max_tokens=12, temperature=0.0)
    # Oracle: the same prompt through /v1/completions, built with the tokenizer's template.
    prompt = server.engine.get_tokenizer().apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    completion = client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0.0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == completion.choices[0].text
    streamed = ""
    for chunk in client.chat.completions.create(
        model="demo", messages=messages, max_tokens=12, temperature=0.0, stream=True
    ):
        streamed += chunk.choices[0].delta.content or ""
    assert streamed == chat.choices[0].message.content


def test_32_concurrent_streams_complete_and_free_all_blocks(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> int:
        stream = await client.completions.create(
            model="demo",
            prompt=f"x{i} = ",
            max_tokens=8,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def run_all() -> list[int]:
        client = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S
        )
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    assert asyncio.run(run_all()) == [8] * 32
    wait_until_idle(server, within_s=5)


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{not json", 400, "JSON"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
        ({"model": "demo", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
        ({"model": "demo", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": "demo", "prompt": 12.5}, 400, "prompt"),
        ({"model": "demo", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "demo", "prompt": list(range(3, 1100))}, 400, "max_model_len"),
        ({"model": "demo"}, 400, "prompt"),
    ],
)
def test_bad_request_gets_error_and_server_keeps_serving(server, client, body, status, message):
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=TIMEOUT_S, **kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["code"] == status
    assert client.completions.create(model="demo", prompt="x", max_tokens=2).choices[0].text is not None


def test_bad_chat_request(server):
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={"messages": "hi"}, timeout=TIMEOUT_S
    )
    assert response.status_code == 400 and "messages" in response.json()["error"]["message"]


# ------------------------------------------------------------------ structured outputs (chapter 15)
# The nested schema of chapter 15 (benchmarks/structured_outputs.py): every string, array and
# number bounded, so that a sampled (not greedy) output ends within max_tokens with finish_reason "stop".
PERSON_SCHEMA = PERSON
PERSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
}
CHAT_BODY = {"messages": [{"role": "user", "content": "a person as JSON"}]}
# The demo model, a code model, pads free JSON whitespace ("{\n\n\n   ...") until max_tokens: the
# requests take xgrammar's fixed layout instead, an option `structured_outputs` adds to `response_format`.
NO_WHITESPACE = {"structured_outputs": {"disable_any_whitespace": True}}


@pytest.mark.ch15
@pytest.mark.parametrize(
    "request_class, body", [(CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, CHAT_BODY)]
)
def test_response_format_and_structured_outputs_become_sampling_params(request_class, body):
    def constraint(**fields):
        return request_class(**body, **fields).to_sampling_params(None).structured_outputs

    assert constraint(response_format=PERSON_FORMAT).json == PERSON_SCHEMA
    assert constraint(response_format={"type": "json_object"}).json_object is True
    assert constraint(response_format={"type": "text"}) is None and constraint() is None
    given = {"regex": "[a-z]+", "whitespace_pattern": " ?"}
    params = constraint(structured_outputs=given, response_format={"type": "text"})
    assert (params.regex, params.whitespace_pattern, params.json) == ("[a-z]+", " ?", None)
    params = constraint(response_format=PERSON_FORMAT, **NO_WHITESPACE)
    assert (params.json, params.disable_any_whitespace) == (PERSON_SCHEMA, True)


@pytest.mark.ch15
def test_json_schema_response_format_streamed_and_not(client):
    """The output is JSON that the schema accepts, on both endpoints, whole and streamed (the four
    requests at once: one batch in the engine)."""
    sampling = {"max_tokens": 256, "temperature": 0.8}
    chat_kwargs = {"model": "demo", "response_format": PERSON_FORMAT, "extra_body": NO_WHITESPACE}
    chat_kwargs.update(CHAT_BODY)
    completion_body = {**NO_WHITESPACE, "response_format": PERSON_FORMAT}
    completion_kwargs = {"prompt": "person = ", "extra_body": completion_body}

    def chat() -> tuple[str, str]:
        choice = client.chat.completions.create(**chat_kwargs, **sampling).choices[0]
        return choice.message.content, choice.finish_reason

    def chat_streamed() -> tuple[str, str]:
        chunks = list(client.chat.completions.create(stream=True, **chat_kwargs, **sampling))
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason

    def completion() -> tuple[str, str]:
        choice = client.completions.create(model="demo", **completion_kwargs, **sampling).choices[0]
        return choice.text, choice.finish_reason

    def completion_streamed() -> tuple[str, str]:
        texts, reasons = stream_completion(client, **completion_kwargs, **sampling)
        return texts[0], reasons[0]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(f) for f in (chat, chat_streamed, completion, completion_streamed)]
        outputs = [future.result() for future in futures]
    for text, finish_reason in outputs:
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)


@pytest.mark.ch15
def test_choice_and_regex_on_completions(client):
    sampling = {"model": "demo", "prompt": PROMPT, "max_tokens": 20, "temperature": 0.8, "n": 4}
    choices = ["yes", "no", "maybe later"]
    out = client.completions.create(extra_body={"structured_outputs": {"choice": choices}}, **sampling)
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.choices)
    regex = r"[a-z]{2,6}_[0-9]{1,3}\((x|y)\)"
    out = client.completions.create(extra_body={"structured_outputs": {"regex": regex}}, **sampling)
    assert all(re.fullmatch(regex, c.text) and c.finish_reason == "stop" for c in out.choices)


def _json_schema(schema: object) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


JSON_OBJECT = {"response_format": {"type": "json_object"}}


@pytest.mark.ch15
@pytest.mark.parametrize(
    "fields, param, message",
    [
        (_json_schema({"type": "nonsense"}), None, "nonsense"),
        (_json_schema([1]), "response_format.json_schema.schema", "dictionary"),
        ({"structured_outputs": {"regex": "("}}, None, "regex"),
        ({"structured_outputs": {"choice": ["a"]}, **JSON_OBJECT}, "structured_outputs", "not both"),
        ({"structured_outputs": {"json": {}}, **_json_schema({})}, "structured_outputs", "not both"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ],
)
def test_bad_constraint_gets_400_and_server_keeps_serving(server, client, fields, param, message):
    for path, body in [("completions", {"prompt": "x"}), ("chat/completions", CHAT_BODY)]:
        response = httpx.post(
            f"{server.base_url}/v1/{path}", json={"model": "demo", **body, **fields}, timeout=TIMEOUT_S
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, param)
        assert message in error["message"], error["message"]
    assert client.completions.create(model="demo", prompt="x", max_tokens=2).choices[0].text is not None
    wait_until_idle(server, within_s=5)


def test_an_internal_error_is_undone_and_keeps_the_connection(server, monkeypatch):
    """Regression: a request that failed after it was registered (here: its message cannot be sent)
    stayed registered in the frontend, and the 500 reset the client's keep-alive connection."""

    async def broken(request) -> None:
        raise OverflowError("int too big to convert")

    monkeypatch.setattr(server.engine.engine_core, "add_request_async", broken)
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as http:
        failed = http.post("/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 2})
        assert failed.status_code == 500
        assert failed.json()["error"]["type"] == "InternalServerError"
        assert not server.engine.request_queues and not server.engine.output_processor.parent_requests
        monkeypatch.undo()
        good = http.post("/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 2})
        assert good.status_code == 200
        # Both on one connection: the 500 did not close it.
        ports = {r.extensions["network_stream"].get_extra_info("client_addr")[1] for r in (failed, good)}
        assert len(ports) == 1


def test_disconnect_mid_stream_aborts_in_core(server):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=TIMEOUT_S) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.call_utility("get_num_unfinished_requests") == 1
    # 1000 tokens would take far longer than this: only an abort frees the request this soon.
    start = time.monotonic()
    wait_until_idle(server, within_s=3)
    assert time.monotonic() - start < 3


@pytest.mark.slow
def test_nano_v1_serve_command():
    """The real entrypoint in its own process: it comes up, serves, and stops on Ctrl-C."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    command = [
        sys.executable,
        "-m",
        "nano_v1.entrypoints.cli",
        "serve",
        "--port",
        str(port),
        "--served-model-name",
        "demo",
        "--max-model-len",
        "128",
        "--num-gpu-blocks-override",
        "32",
    ]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", proc, 120, proc.stderr.read)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S
        )
        assert (
            client.completions.create(model="demo", prompt="import", max_tokens=3).usage.completion_tokens
            >= 1
        )
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    # Ctrl-C is a clean stop. Regression: it printed a KeyboardInterrupt traceback.
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]


def test_engine_core_killed_requests_fail_fast(server):
    """Last: a second server whose engine core we SIGKILL mid-stream."""
    doomed = ServerThread(**ENGINE_KWARGS)
    try:
        client = doomed.client()
        pid = doomed.engine.engine_core.resources.proc.pid
        stream = client.completions.create(
            model="demo", prompt=PROMPT, max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        start = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine core") as streamed:
            for _ in stream:
                pass
        assert time.monotonic() - start < 10
        with pytest.raises(openai.APIStatusError, match="engine core") as info:
            client.completions.create(model="demo", prompt="x", max_tokens=2)
        assert info.value.status_code == 503
        # One spelling of the error type, in a stream's error event and in a 503 response alike.
        assert streamed.value.body["type"] == info.value.body["type"] == "ServiceUnavailableError"
        assert httpx.get(f"{doomed.base_url}/health", timeout=TIMEOUT_S).status_code == 503
    finally:
        doomed.stop()
