"""Disaggregated serving over HTTP (chapter 16): a prefill server, a decode server and the proxy.

Three `nano-v1 serve` processes on the demo model (float32, block size 16): a prefill
server ("kv_producer") and a decode server ("kv_consumer") sharing a SharedStorageConnector
directory, behind the example proxy (examples/online_serving/disaggregated_serving/
disagg_proxy.py), and a plain server without a connector, the oracle: greedy answers
through the proxy, whole or streamed, completions or chat, must be the plain server's,
character for character. What the decode server loaded is read from its usage
(`--enable-prompt-tokens-details`: `prompt_tokens_details.cached_tokens`), against v0.11.0's
arithmetic: a prompt of L tokens loads its whole blocks before token L - 1, except when L - 1
is a multiple of the block size (the lookup names a shorter prefix than the save: recomputed).

`RequestOutput.kv_transfer_params` is checked offline, with a connector whose finished
requests report params (tests/helpers/kv_connector.py).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from helpers.kv_connector import ParamsSharedStorageConnector
from helpers.servers import TIMEOUT_S

from benchmarks.disagg_itl import running_pd, running_plain_server
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.entrypoints.llm import LLM
from nano_v1.entrypoints.openai.protocol import CompletionRequest
from nano_v1.sampling_params import SamplingParams

pytestmark = pytest.mark.ch16  # every test but the last two talks to real servers

BLOCK_SIZE = 16
ENGINE_KWARGS: dict[str, Any] = {
    "dtype": "float32", "max_model_len": 256, "block_size": BLOCK_SIZE, "num_gpu_blocks_override": 256,
}  # fmt: skip
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> dict[str, str]:
    """The trio and the oracle, started in parallel once for the module; 1 torch thread each."""
    storage = str(tmp_path_factory.mktemp("kv"))
    oracle = running_plain_server(ENGINE_KWARGS, torch_num_threads=1)
    details = ["--enable-prompt-tokens-details"]
    with running_pd(storage, ENGINE_KWARGS, extra_flags=details, also=[oracle]) as (pd, (oracle_url,)):
        yield {"proxy": pd.proxy_url, "decode": pd.decode_url, "prefill": pd.prefill_url, "oracle": oracle_url}


async def ask(client: httpx.AsyncClient, base_url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, the JSON answer) of a whole request; of a streamed one, (status, the concatenated text)."""
    if not body.get("stream"):
        response = await client.post(f"{base_url}{path}", json=body)
        return response.status_code, response.json()
    text = ""
    async with client.stream("POST", f"{base_url}{path}", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                text += choice["text"] if "text" in choice else choice["delta"].get("content") or ""
    return response.status_code, text


def answer_text(answer: Any) -> str:
    if isinstance(answer, str):
        return answer  # streamed
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def ask_all(base_url: str, requests: list[tuple[str, dict[str, Any]]]) -> list[tuple[int, Any]]:
    """All `requests` ((path, body)) at once against one server."""

    async def run() -> list[tuple[int, Any]]:
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
            return await asyncio.gather(*(ask(client, base_url, path, body) for path, body in requests))

    return asyncio.run(run())


def generation_tokens(base_url: str) -> float:
    """The server's `vllm:generation_tokens_total` (Prometheus text format)."""
    for line in httpx.get(f"{base_url}/metrics", timeout=TIMEOUT_S).text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("no vllm:generation_tokens_total in /metrics")


def token_prompt(length: int, seed: int) -> list[int]:
    """Distinct token-id prompts: no two share a first block (nor a saved prefix)."""
    return [(seed * 37 + 11 * j) % 400 + 1 for j in range(length)]


def completion(prompt: Any, stream: bool) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": stream}


def chat(content: str, stream: bool) -> tuple[str, dict[str, Any]]:
    body = {"messages": [{"role": "user", "content": content}], "max_completion_tokens": MAX_TOKENS}
    return "/v1/chat/completions", {**body, "temperature": 0.0, "stream": stream}


def test_concurrent_requests_through_the_proxy_equal_a_single_server(servers):
    """8 at once, completions and chat, whole and streamed: the plain server's text exactly; the
    prefill server made one token per request (the proxy's max_tokens=1)."""
    requests = [
        completion("def fibonacci(n):\n    if n < 2:\n        return n\n    return", stream=False),
        completion("import numpy as np\n\ndef softmax(x):\n", stream=True),
        completion(token_prompt(40, 1), stream=False),
        completion(token_prompt(57, 2), stream=True),
        chat("write a function that sorts a list of numbers in place", stream=False),
        chat("explain recursion with an example in python code please", stream=True),
        chat("hello", stream=False),
        completion("class Stack:\n    def __init__(self):\n", stream=True),
    ]
    generated_before = generation_tokens(servers["prefill"])
    through_proxy = ask_all(servers["proxy"], requests)
    expected = ask_all(servers["oracle"], requests)
    assert [status for status, _ in through_proxy] == [200] * len(requests)
    assert generation_tokens(servers["prefill"]) - generated_before == len(requests)
    texts = [answer_text(answer) for _, answer in through_proxy]
    assert all(texts)
    assert texts == [answer_text(answer) for _, answer in expected]


@pytest.mark.parametrize("stream", [False, True])
def test_decode_server_loads_the_prefilled_blocks(servers, stream):
    """Fresh prompts of 20, 40, 50 tokens load 16, 32, 48 tokens' KV on the decode server; one
    of 33 (32 = 2 blocks before its last token: v0.11.0 looks for a 16-token prefix, 32 were
    saved) loads nothing; all answer the plain server's tokens."""
    lengths = [20, 40, 50, 33]
    seed = 100 if stream else 200  # each parametrization its own prompts: no local prefix-cache hit
    requests = []
    for i, n in enumerate(lengths):
        path, body = completion(token_prompt(n, seed + i), stream)
        if stream:
            body["stream_options"] = {"include_usage": True}
        requests.append((path, body))
    if stream:  # the usage chunk's cached tokens: read it from the raw stream
        cached = [stream_usage(servers["proxy"], path, body).get("prompt_tokens_details") for path, body in requests]
        answers = [None] * len(requests)
    else:
        answers = ask_all(servers["proxy"], requests)
        cached = [answer["usage"]["prompt_tokens_details"] for _, answer in answers]
    loaded = [(n - 2) // BLOCK_SIZE * BLOCK_SIZE for n in lengths]
    assert loaded == [16, 32, 48, 16]
    assert [c and c["cached_tokens"] for c in cached] == [16, 32, 48, None]
    if not stream:
        expected = ask_all(servers["oracle"], requests)
        assert [answer_text(a) for _, a in answers] == [answer_text(a) for _, a in expected]


def stream_usage(base_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The usage chunk of one streamed request."""
    usage = None
    with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[len("data: "):]).get("usage") or usage
    return usage


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "temperature": -1.0}),  # the prefill server's 400
    ("/v1/completions", {"prompt": "x", "kv_transfer_params": "not a dict"}),  # the decode server's
    ("/v1/chat/completions", {"messages": [], "max_tokens": 4}),
    ("/v1/completions", {"prompt": "x", "no_such_field": 1}),
]


def test_bad_requests_are_400s_in_openai_shape_and_the_rest_complete(servers):
    """Errors pass through the proxy with their status and OpenAI error body; the good
    requests sent alongside still answer the plain server's text."""
    good = [completion(token_prompt(30 + i, 300 + i), stream=bool(i % 2)) for i in range(4)]
    answers = ask_all(servers["proxy"], BAD_REQUESTS + good)
    for status, answer in answers[: len(BAD_REQUESTS)]:
        assert status == 400
        assert set(answer) == {"error"}
        assert answer["error"]["code"] == 400 and answer["error"]["type"] == "BadRequestError"
        assert answer["error"]["message"]
    kv_error = answers[1][1]["error"]
    assert kv_error["param"] == "kv_transfer_params" and "dict" in kv_error["message"]
    expected = ask_all(servers["oracle"], good)
    assert [s for s, _ in answers[len(BAD_REQUESTS):]] == [200] * len(good)
    assert [answer_text(a) for _, a in answers[len(BAD_REQUESTS):]] == [answer_text(a) for _, a in expected]
    not_json = httpx.post(f"{servers['proxy']}/v1/completions", content=b"{oops", timeout=TIMEOUT_S)
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == 400


@pytest.mark.slow  # each starts an engine core to refuse its config
@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"kv_connector": "SharedStorageConnector",', "kv_transfer_config is not valid JSON"),
        ('{"kv_connector": "NoSuchConnector", "kv_role": "kv_producer"}', "Unsupported connector type: 'NoSuchConnector'"),
    ],
)
def test_serve_refuses_a_bad_kv_transfer_config(config, message):
    """One line naming the problem and exit code 2, not a traceback: bad JSON (found in the frontend) and
    an unknown connector (found in the engine-core process, which reports it to the frontend)."""
    command = [sys.executable, "-m", "nano_v1.entrypoints.cli", "serve", "--port", "0",
               "--max-model-len", "64", "--kv-transfer-config", config]  # fmt: skip
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"nano-v1: error: {message}" in result.stderr
    assert "Traceback" not in result.stderr


def test_kv_transfer_params_reach_sampling_params_and_are_validated():
    request = CompletionRequest(prompt="x", vllm_xargs={"a": 1}, kv_transfer_params={"do_remote_decode": True})
    extra_args = request.to_sampling_params(default_max_tokens=None).extra_args
    assert extra_args == {"a": 1, "kv_transfer_params": {"do_remote_decode": True}}
    assert CompletionRequest(prompt="x").to_sampling_params(default_max_tokens=None).extra_args is None
    with pytest.raises(ValueError, match="kv_transfer_params"):
        CompletionRequest(prompt="x", kv_transfer_params=[1])


def test_request_output_carries_the_connectors_kv_transfer_params(tmp_path):
    """The connector's `request_finished` params reach the final `RequestOutput` (n=1 and n=2),
    and only a request that asked for a remote decode gets any."""
    args = EngineArgs(
        dtype="float32", max_model_len=128, block_size=BLOCK_SIZE, num_gpu_blocks_override=64,
        kv_transfer_config={"kv_connector": ParamsSharedStorageConnector.__name__, "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}},
    )  # fmt: skip
    llm = LLM.from_engine_args(args, enable_multiprocessing=False)  # the connector is registered in this process
    try:
        prompt = {"prompt_token_ids": token_prompt(40, 7)}
        remote = {"kv_transfer_params": {"do_remote_decode": True}}
        outputs = llm.generate(
            [prompt, prompt, prompt],
            [
                SamplingParams(max_tokens=1, temperature=0.0, extra_args=remote),
                SamplingParams(max_tokens=1, temperature=0.0),
                SamplingParams(max_tokens=1, n=2, temperature=1.0, seed=0, extra_args=remote),
            ],
            use_tqdm=False,
        )
    finally:
        llm.llm_engine.shutdown()
    first, plain, pair = outputs
    assert first.kv_transfer_params["do_remote_prefill"] is True
    assert first.kv_transfer_params["num_prompt_tokens"] == 40
    assert len(first.kv_transfer_params["remote_block_ids"]) == 3  # 41 slots in blocks of 16
    assert plain.kv_transfer_params is None
    assert pair.kv_transfer_params is not None and pair.kv_transfer_params["num_prompt_tokens"] == 40
