"""`nano-v1 serve` as users run it: a real process, the official `openai` client, load, bad input, faults.

Two servers start at once (they share the machine's cores while they import): the main
one serves every test in order, and the last test stops it with SIGTERM; the second one
exists to have its engine core killed. Oracles: the offline engine in this process
(same arguments, float32) for text and logprobs; the server's own `/metrics` for what is
left running; the process table and the server's temporary directory for what is left
behind. Every wait is bounded, so a hang fails a test instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

# The serving stack's packages: the GPU image has none of them (README), and skips the module.
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from helpers.servers import wait_until_healthy
from prometheus_client.parser import text_string_to_metric_families

import nano_v1
from nano_v1 import LLM, SamplingParams

pytestmark = pytest.mark.ch09  # every test talks to a real server

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60
API_KEY = "sk-nano-test"
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "2048", "--num-gpu-blocks-override", "512"]
PROMPT = "def fibonacci(n):\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`nano-v1 serve` in a process of its own, with a temporary directory of its own (TMPDIR)."""

    def __init__(self, *flags: str, port: int | None = None, env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # A short prefix: IPC socket paths are limited to ~100 bytes.
        self.tmpdir = tempfile.mkdtemp(prefix="nano-serve-")
        self.log = tempfile.TemporaryFile("w+")
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "TMPDIR": self.tmpdir,
            **(env or {}),
        }
        # conftest's in-process default is not the server's.
        self.env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        command = [sys.executable, "-m", "nano_v1.entrypoints.cli", "serve", "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(command, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        self.descendants: list[psutil.Process] = []

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def wait_healthy(self, timeout_s: float = 300) -> None:
        wait_until_healthy(self.base_url, self.proc, timeout_s, lambda: self.output()[-3000:])
        # Everything it started (forkserver, engine core, resource tracker), to check that all exit with it.
        self.descendants = psutil.Process(self.proc.pid).children(recursive=True)

    def engine_core_pid(self) -> int:
        line = next(line for line in self.output().splitlines() if "EngineCore process started" in line)
        return int(line.rsplit("pid ", 1)[1].rstrip(")"))

    def metrics(self) -> dict[str, float]:
        """The /metrics page as {name with labels: value} (labels model_name and engine dropped)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=TIMEOUT_S).text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
                key = sample.name + (json.dumps(labels, sort_keys=True) if labels else "")
                values[key] = sample.value
        return values

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S, **kwargs
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S
        )

    def wait_exit(self, timeout_s: float) -> int:
        returncode = self.proc.wait(timeout=timeout_s)
        _, alive = psutil.wait_procs(self.descendants, timeout=10)
        assert not alive, f"left running: {alive}"
        return returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for child in self.descendants:
            if child.is_running():
                child.kill()
        self.log.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


@pytest.fixture(scope="module")
def servers():
    main = ServeProcess(
        *ENGINE_FLAGS,
        "--api-key",
        API_KEY,
        "--max-request-body-bytes",
        str(20 * 2**20),
        env={"VLLM_LOG_STATS_INTERVAL": "1", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "2"},
    )
    doomed = ServeProcess(*ENGINE_FLAGS, "--served-model-name", "doomed", "--disable-log-stats")
    try:
        main.wait_healthy()
        doomed.wait_healthy()
        yield main, doomed
    finally:
        main.close()
        doomed.close()


@pytest.fixture(scope="module")
def server(servers) -> ServeProcess:
    return servers[0]


@pytest.fixture(scope="module")
def offline() -> LLM:
    """The oracle: the same engine in this process."""
    return LLM(dtype="float32", max_model_len=2048, num_gpu_blocks_override=512)


def test_models_version_and_default_name(server):
    # No --served-model-name: the bundled model is "demo", never the checkpoint's absolute path.
    assert [m.id for m in server.client().models.list().data] == ["demo"]
    assert httpx.get(f"{server.base_url}/version", timeout=TIMEOUT_S).json() == {
        "version": nano_v1.__version__
    }


def test_errors_name_the_served_model_never_its_path(server):
    """Regression: the "not multimodal" error, open to anyone through /tokenize, named the server's
    absolute path of the model."""
    from nano_v1.demo_model import DEMO_MODEL_PATH

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}]
    for path, body in (
        ("/tokenize", {"messages": messages}),
        ("/v1/chat/completions", {"messages": messages}),
    ):
        response = httpx.post(
            f"{server.base_url}{path}",
            json=body,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=TIMEOUT_S,
        )
        message = response.json()["error"]["message"]
        assert response.status_code == 400 and "'demo'" in message, message
        assert str(DEMO_MODEL_PATH) not in message and "/" not in message, message


def test_api_key_required_on_v1_only(server):
    with pytest.raises(openai.AuthenticationError, match="API key"):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0).models.list()
    response = httpx.get(f"{server.base_url}/v1/models", timeout=TIMEOUT_S)
    assert response.status_code == 401 and response.json()["error"]["type"] == "UnauthorizedError"
    assert httpx.get(f"{server.base_url}/health", timeout=TIMEOUT_S).status_code == 200


def test_64_concurrent_greedy_streams_equal_offline(server, offline):
    prompts = [f"def function_{i}(x):\n" for i in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    expected = [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model="demo", prompt=prompt, max_tokens=16, temperature=0.0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run_all() -> list[str]:
        client = server.async_client()
        return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(run_all()) == expected


def test_stop_strings_of_1_to_12_characters_streamed_and_not(server, offline):
    """Regression (5+ characters): streamed text repeated characters ("\\ndedef ...")."""
    params = SamplingParams(temperature=0.0, max_tokens=32)
    full = offline.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    cases = []  # (stop string, expected text, finish reason)
    for length in range(1, 13):
        hit = full[16 : 16 + length]  # from inside the output ...
        cases += [
            (hit, full[: full.index(hit)], "stop"),
            ("§" * length, full, "length"),
        ]  # ... and never in it
    client = server.async_client()

    async def one(stop: str, stream: bool) -> tuple[str, str]:
        kwargs = dict(model="demo", prompt=PROMPT, max_tokens=32, temperature=0.0, stop=[stop], stream=stream)
        if not stream:
            choice = (await client.completions.create(**kwargs)).choices[0]
            return choice.text, choice.finish_reason
        text, reason = "", None
        async for chunk in await client.completions.create(**kwargs):
            for choice in chunk.choices:
                text, reason = text + choice.text, choice.finish_reason or reason
        return text, reason

    async def run() -> list[tuple[str, str]]:
        return await asyncio.gather(*(one(stop, stream) for stop, _, _ in cases for stream in (False, True)))

    got = asyncio.run(run())
    assert got == [(expected, reason) for _, expected, reason in cases for _ in (False, True)]


def test_completion_logprobs_equal_offline(server, offline):
    prompt = "import os\n"
    expected = offline.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=6, logprobs=3), use_tqdm=False
    )
    completion = expected[0].outputs[0]
    tokenizer = offline.get_tokenizer()
    token_logprobs = [p[t] for t, p in zip(completion.token_ids, completion.logprobs)]
    top = [{tokenizer.decode([t]): lp for t, lp in p.items()} for p in completion.logprobs]
    client = server.client()
    whole = client.completions.create(model="demo", prompt=prompt, max_tokens=6, temperature=0.0, logprobs=3)
    logprobs = whole.choices[0].logprobs
    assert logprobs.token_logprobs == token_logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in completion.token_ids]
    assert logprobs.top_logprobs == top and all(3 <= len(t) <= 4 for t in top)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    streamed = [
        choice.logprobs
        for chunk in client.completions.create(
            model="demo", prompt=prompt, max_tokens=6, temperature=0.0, logprobs=3, stream=True
        )
        for choice in chunk.choices
    ]
    assert [lp for chunk in streamed for lp in chunk.token_logprobs] == token_logprobs
    assert [o for chunk in streamed for o in chunk.text_offset] == logprobs.text_offset


def test_completion_echo_and_prompt_logprobs_equal_offline(server, offline):
    """`echo` puts the prompt before the text and, with logprobs, the prompt tokens' logprobs (the
    first null) before the sampled ones', whole and streamed (the prompt in the first chunk);
    `prompt_logprobs` come on the choice as `RequestOutput.prompt_logprobs`, and on a chat response."""
    prompt = "def add(a, b):\n"
    (expected,) = offline.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, prompt_logprobs=2), use_tqdm=False
    )
    completion = expected.outputs[0]
    tokenizer = offline.get_tokenizer()
    ids = expected.prompt_token_ids + completion.token_ids
    token_logprobs = [None] + [
        p[t].logprob for t, p in zip(expected.prompt_token_ids[1:], expected.prompt_logprobs[1:])
    ] + [p[t] for t, p in zip(completion.token_ids, completion.logprobs)]
    client = server.client()
    kwargs = dict(model="demo", prompt=prompt, max_tokens=5, temperature=0.0, logprobs=2, echo=True)
    choice = client.completions.create(**kwargs).choices[0]
    assert choice.text == prompt + completion.text
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    assert choice.logprobs.token_logprobs == pytest.approx(token_logprobs, abs=1e-4)
    assert choice.logprobs.top_logprobs[0] is None
    assert [len(top) for top in choice.logprobs.top_logprobs[1:]] == [
        len(p) for p in expected.prompt_logprobs[1:] + completion.logprobs
    ]
    assert choice.logprobs.text_offset == [sum(map(len, choice.logprobs.tokens[:i])) for i in range(len(ids))]
    # echo with logprobs asks for prompt logprobs: vLLM returns them on the choice too.
    got = choice.model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(expected.prompt_token_ids)
    for position, want in zip(got[1:], expected.prompt_logprobs[1:]):
        assert {int(t) for t in position} == set(want)
        for t, lp in want.items():
            entry = position[str(t)]
            assert entry["logprob"] == pytest.approx(lp.logprob, abs=1e-4) and entry["rank"] == lp.rank
            assert entry["decoded_token"] == tokenizer.decode([t])

    chunks = [c for chunk in client.completions.create(**kwargs, stream=True) for c in chunk.choices]
    assert chunks[0].text.startswith(prompt)
    assert "".join(c.text for c in chunks) == choice.text
    assert [lp for c in chunks for lp in c.logprobs.token_logprobs] == pytest.approx(token_logprobs, abs=1e-4)
    assert [o for c in chunks for o in c.logprobs.text_offset] == choice.logprobs.text_offset

    # Token ids in, the prompt decoded; prompt_logprobs without echo leave the text alone.
    by_ids = client.completions.create(
        model="demo", prompt=expected.prompt_token_ids, max_tokens=5, temperature=0.0, echo=True
    ).choices[0]
    assert by_ids.text == tokenizer.decode(expected.prompt_token_ids) + completion.text
    plain = client.completions.create(
        model="demo", prompt=prompt, max_tokens=5, temperature=0.0, extra_body={"prompt_logprobs": 0}
    ).choices[0]
    assert plain.text == completion.text and plain.logprobs is None
    assert [None if p is None else len(p) for p in plain.model_extra["prompt_logprobs"]][:2] == [None, 1]

    messages = [{"role": "user", "content": "sort a list"}]
    chat = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=2, temperature=0.0, extra_body={"prompt_logprobs": 1}
    )
    chat_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert len(chat.model_extra["prompt_logprobs"]) == len(tokenizer.encode(chat_prompt, add_special_tokens=False))


def test_penalties_bias_and_vllm_extras_equal_offline(server, offline):
    """OpenAI's penalties and logit_bias, and vLLM's extras, reach the engine as `SamplingParams`
    would offline: greedy, and seeded sampling (where min_p and top_k matter too)."""
    tokenizer = offline.get_tokenizer()
    colon, newline = tokenizer.encode(":")[0], tokenizer.encode("\n")[0]
    settings = {
        "presence_penalty": 0.8,
        "frequency_penalty": 0.6,
        "repetition_penalty": 1.3,
        "logit_bias": {colon: 4.0, newline: -2.5},
        "min_p": 0.05,
        "top_k": 20,
        "bad_words": ["(self"],
        "allowed_token_ids": list(range(3, 2000)),
    }
    client = server.client()
    for temperature, seed in ((0.0, None), (0.9, 11)):
        expected = (
            offline.generate(
                "class Stack:",
                SamplingParams(
                    temperature=temperature, seed=seed, max_tokens=16, ignore_eos=True, **settings
                ),
                use_tqdm=False,
            )[0]
            .outputs[0]
            .text
        )
        extra = {
            k: settings[k] for k in ("repetition_penalty", "min_p", "top_k", "bad_words", "allowed_token_ids")
        }
        completion = client.completions.create(
            model="demo",
            prompt="class Stack:",
            max_tokens=16,
            temperature=temperature,
            seed=seed,
            presence_penalty=settings["presence_penalty"],
            frequency_penalty=settings["frequency_penalty"],
            logit_bias={str(t): b for t, b in settings["logit_bias"].items()},
            extra_body={"ignore_eos": True, **extra},
        )
        assert completion.choices[0].text == expected
        plain = (
            offline.generate(
                "class Stack:",
                SamplingParams(temperature=temperature, seed=seed, max_tokens=16, ignore_eos=True),
                use_tqdm=False,
            )[0]
            .outputs[0]
            .text
        )
        assert plain != expected  # the settings change the output


def test_chat_logprobs_equal_offline(server, offline):
    messages = [{"role": "user", "content": "sort a list"}]
    prompt = offline.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    (expected,) = offline.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=5, logprobs=2), use_tqdm=False
    )
    completion = expected.outputs[0]
    client = server.client()
    for stream in (False, True):
        response = client.chat.completions.create(
            model="demo",
            messages=messages,
            max_tokens=5,
            temperature=0.0,
            logprobs=True,
            top_logprobs=2,
            stream=stream,
        )
        choices = [c for chunk in response for c in chunk.choices] if stream else response.choices
        content = [entry for c in choices if c.logprobs for entry in c.logprobs.content]
        assert [entry.logprob for entry in content] == [
            p[t] for t, p in zip(completion.token_ids, completion.logprobs)
        ]
        for entry, position in zip(content, completion.logprobs):
            ranked = sorted(position.values(), reverse=True)[:2]
            assert [t.logprob for t in entry.top_logprobs] == ranked


def test_metrics_count_what_was_served(server):
    before = server.metrics()
    response = server.client().completions.create(
        model="demo", prompt=[5, 6, 7, 8, 9], max_tokens=7, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 7
    after = server.metrics()
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 5
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 7
    assert (
        after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"]
        == 1
    )
    assert (
        after["vllm:inter_token_latency_seconds_count"] - before["vllm:inter_token_latency_seconds_count"]
        == 6
    )
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] == 5
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert after[gauge] == 0
    assert not any(name.startswith("vllm:spec_decode") for name in after)  # speculation is off
    assert "Avg prompt throughput" in server.output()  # the periodic line (every second here)


def test_request_success_counts_each_completion_by_finished_reason(server):
    """Regression: `vllm:request_success_total` was missing, so what clients saw could not be checked."""
    before = server.metrics()
    client = server.client()
    by_length = client.completions.create(
        model="demo", prompt="a", max_tokens=3, n=2, extra_body={"ignore_eos": True}
    )
    by_stop = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=32, temperature=0.0, stop=["\n"]
    )
    assert [c.finish_reason for c in by_length.choices + by_stop.choices] == ["length", "length", "stop"]
    after = server.metrics()
    for reason, count in (("length", 2), ("stop", 1), ("abort", 0)):
        key = f'vllm:request_success_total{{"finished_reason": "{reason}"}}'
        assert after[key] - before.get(key, 0) == count, reason


def test_tokenize_and_detokenize(server, offline):
    tokenizer = offline.get_tokenizer()
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    body = httpx.post(
        f"{server.base_url}/tokenize", json={"prompt": PROMPT, "return_token_strs": True}, timeout=TIMEOUT_S
    ).json()
    assert body == {
        "count": len(ids),
        "max_model_len": 2048,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}, timeout=TIMEOUT_S).json()
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(templated, add_special_tokens=False)
    back = httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids}, timeout=TIMEOUT_S).json()
    assert back == {"prompt": PROMPT}


def test_prompt_shapes_as_openai_reads_them(server, offline):
    """Regression: `["1", "2"]` and `[true, false]` were token ids 1, 2 and 1, 0; a list of strings
    was a 400. Now a list of strings (or of token-id lists) is a batch: prompt i's n choices
    are indices i*n .. i*n+n-1; a list of ints is token ids; anything else is a 400."""
    params = SamplingParams(temperature=0.0, max_tokens=4, n=2)
    tokenizer = offline.get_tokenizer()
    texts = ["1", "2", "def f"]
    expected = [c.text for o in offline.generate(texts, params, use_tqdm=False) for c in o.outputs]
    prompt_tokens = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts)
    client = server.client()
    as_token_ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    for prompt in (texts, as_token_ids):
        whole = client.completions.create(model="demo", prompt=prompt, max_tokens=4, temperature=0.0, n=2)
        assert [c.index for c in whole.choices] == list(range(6))
        assert [c.text for c in whole.choices] == expected
        assert whole.usage.prompt_tokens == prompt_tokens
        streamed = {i: "" for i in range(6)}
        usage = None
        for chunk in client.completions.create(
            model="demo",
            prompt=prompt,
            max_tokens=4,
            temperature=0.0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        ):
            for choice in chunk.choices:
                streamed[choice.index] += choice.text
            usage = chunk.usage or usage
        assert list(streamed.values()) == expected and usage.prompt_tokens == prompt_tokens
    ids = client.completions.create(model="demo", prompt=as_token_ids[2], max_tokens=4, temperature=0.0)
    assert ids.choices[0].text == expected[4] and ids.usage.prompt_tokens == len(as_token_ids[2])
    for bad in ([True, False], [1, "a"], ["a", 1], [[1], "a"], [[True]], [1.0], {"a": 1}):
        with pytest.raises(openai.BadRequestError, match="prompt"):
            client.completions.create(model="demo", prompt=bad, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="at most 128"):
        client.completions.create(model="demo", prompt=["a"] * 65, max_tokens=1, n=2)
    assert_idle(server)


def completion(**fields) -> dict:
    return {"model": "demo", "prompt": "x", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


DEEP_JSON = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
# id: (method, path, body: dict for JSON or raw bytes, status, a word the message must contain)
BAD_REQUESTS = {
    "seed-over-uint64": ("POST", "/v1/completions", completion(seed=2**64), 400, "seed"),
    "seed-below-int64": ("POST", "/v1/completions", completion(seed=-(2**70)), 400, "seed"),
    "chat-min-tokens-over-uint64": (
        "POST",
        "/v1/chat/completions",
        chat(min_tokens=2**64, max_tokens=None),  # no max_tokens: only the int64 bound can say no
        400,
        "min_tokens",
    ),
    "top-k-huge": ("POST", "/v1/completions", completion(top_k=2**80), 400, "top_k"),
    "max-tokens-huge": ("POST", "/v1/completions", completion(max_tokens=2**70), 400, "max_tokens"),
    "lone-surrogate-prompt": (
        "POST",
        "/v1/completions",
        b'{"model": "demo", "prompt": "a\\ud800b"}',
        400,
        "surrogate",
    ),
    "lone-surrogate-message": (
        "POST",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        400,
        "surrogate",
    ),
    "no-messages": ("POST", "/v1/chat/completions", chat(messages=[]), 400, "messages"),
    "messages-not-a-list": ("POST", "/v1/chat/completions", chat(messages="hi"), 400, "messages"),
    "n-2000": ("POST", "/v1/completions", completion(n=2000), 400, "n"),
    "logprobs-21": ("POST", "/v1/completions", completion(logprobs=21), 400, "max allowed: 20"),
    "logprobs-negative": ("POST", "/v1/completions", completion(logprobs=-1), 400, "logprobs"),
    "top-logprobs-without-logprobs": (
        "POST",
        "/v1/chat/completions",
        chat(top_logprobs=2),
        400,
        "top_logprobs",
    ),
    "prompt-logprobs-21": ("POST", "/v1/completions", completion(prompt_logprobs=21), 400, "prompt logprobs of 21"),
    "chat-prompt-logprobs-whole-vocabulary": (
        "POST",
        "/v1/chat/completions",
        chat(prompt_logprobs=-1),
        400,
        "prompt logprobs of",
    ),
    "prompt-logprobs-negative": ("POST", "/v1/completions", completion(prompt_logprobs=-2), 400, "prompt_logprobs"),
    "prompt-logprobs-streamed": (
        "POST",
        "/v1/completions",
        completion(prompt_logprobs=1, stream=True),
        400,
        "prompt_logprobs",
    ),
    "echo-logprobs-21": ("POST", "/v1/completions", completion(echo=True, logprobs=21), 400, "max allowed: 20"),
    "best-of": ("POST", "/v1/completions", completion(best_of=3), 400, "best_of"),
    "suffix": ("POST", "/v1/completions", completion(suffix="}"), 400, "suffix"),
    "presence-penalty-over-2": (
        "POST",
        "/v1/completions",
        completion(presence_penalty=2.5),
        400,
        "presence_penalty must be in [-2, 2]",
    ),
    "frequency-penalty-under-2": (
        "POST",
        "/v1/chat/completions",
        chat(frequency_penalty=-3),
        400,
        "frequency_penalty must be in [-2, 2]",
    ),
    "repetition-penalty-0": (
        "POST",
        "/v1/completions",
        completion(repetition_penalty=0),
        400,
        "repetition_penalty must be greater than zero",
    ),
    "min-p-over-1": ("POST", "/v1/completions", completion(min_p=1.5), 400, "min_p must be in [0, 1]"),
    "logit-bias-not-a-token-id": (
        "POST",
        "/v1/completions",
        completion(logit_bias={"the": 10}),
        400,
        "logit_bias keys must be token ids",
    ),
    "logit-bias-over-100": (
        "POST",
        "/v1/completions",
        completion(logit_bias={"5": 101}),
        400,
        "logit_bias values must be in [-100, 100]",
    ),
    "logit-bias-out-of-vocab": (
        "POST",
        "/v1/completions",
        completion(logit_bias={"5": 1, "1000000": 1}),
        400,
        "logit_bias has out-of-vocabulary token ids [1000000]",
    ),
    "allowed-token-ids-empty": (
        "POST",
        "/v1/completions",
        completion(allowed_token_ids=[]),
        400,
        "allowed_token_ids is not None and empty",
    ),
    "allowed-token-ids-out-of-vocab": (
        "POST",
        "/v1/chat/completions",
        chat(allowed_token_ids=[5, 10**6]),
        400,
        "allowed_token_ids has out-of-vocabulary token ids",
    ),
    "bad-words-blank": ("POST", "/v1/completions", completion(bad_words=[" "]), 400, "bad_words"),
    "bad-word-lone-surrogate": (
        "POST",
        "/v1/completions",
        b'{"model": "demo", "prompt": "x", "bad_words": ["a\\ud800"]}',
        400,
        "surrogate",
    ),
    "response-format-structural-tag": (
        "POST",
        "/v1/chat/completions",
        chat(response_format={"type": "structural_tag"}),
        400,
        "response_format",
    ),
    "unknown-field": (
        "POST",
        "/v1/completions",
        completion(length_penalty=1.2),
        400,
        "length_penalty",
    ),
    "max-tokens-0": ("POST", "/v1/completions", completion(max_tokens=0), 400, "max_tokens"),
    "temperature-negative": ("POST", "/v1/completions", completion(temperature=-1), 400, "temperature"),
    "top-p-over-1": ("POST", "/v1/completions", completion(top_p=1.5), 400, "top_p"),
    "empty-stop": ("POST", "/v1/completions", completion(stop=[""]), 400, "stop"),
    "min-over-max-tokens": (
        "POST",
        "/v1/completions",
        completion(min_tokens=5, max_tokens=2),
        400,
        "min_tokens",
    ),
    "token-out-of-vocab": ("POST", "/v1/completions", completion(prompt=[5, 10**6]), 400, "vocabulary"),
    "no-token": ("POST", "/v1/completions", completion(prompt=[]), 400, "empty"),
    "empty-prompt": ("POST", "/v1/completions", completion(prompt=""), 400, "empty"),
    "prompt-too-long": (
        "POST",
        "/v1/completions",
        completion(prompt=list(range(3, 2100))),
        400,
        "max_model_len",
    ),
    "prompt-a-float": ("POST", "/v1/completions", completion(prompt=12.5), 400, "prompt"),
    "unknown-model": ("POST", "/v1/completions", completion(model="gpt-4"), 404, "does not exist"),
    "not-utf-8": ("POST", "/v1/completions", b'{"model": "demo", "prompt": "\xff"}', 400, "utf-8"),
    "not-json": ("POST", "/v1/completions", b"{not json", 400, "JSON"),
    "deep-json": ("POST", "/v1/completions", DEEP_JSON, 400, "recursion"),
    "wrong-method": ("GET", "/v1/completions", None, 405, "Method Not Allowed"),
    "unknown-path": ("POST", "/v1/nothing-here", completion(), 404, "Not Found"),
    "tokenize-lone-surrogate": ("POST", "/tokenize", {"prompt": "a\ud800"}, 400, "surrogate"),
    "detokenize-out-of-vocab": ("POST", "/detokenize", {"tokens": [-1]}, 400, "vocabulary"),
}


@pytest.fixture(scope="module")
def http(server):
    """One keep-alive connection for every bad request."""
    headers = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def ports() -> set[int]:
    """The local ports `http`'s requests went out from: one, if no answer closed the connection."""
    return set()


def client_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_input_is_an_error_in_openai_shape(http, ports, case):
    """Regression: huge integers, lone surrogates and `messages: []` were 500s; other errors were
    not in OpenAI's shape, and unimplemented fields were silently ignored."""
    method, path, body, status, word = BAD_REQUESTS[case]
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    response = http.request(method, path, content=content)
    ports.add(client_port(response))
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert word.lower() in error["message"].lower(), error["message"]


def test_bad_inputs_left_nothing_behind_and_kept_the_connection(server, http, ports):
    """Regression: each of those 500s leaked the request's frontend state and reset the connection."""
    good = http.post("/v1/completions", content=json.dumps(completion()).encode())
    ports.add(client_port(good))
    assert good.status_code == 200 and len(ports) == 1
    assert_idle(server)


def test_too_large_body_is_a_413(server):
    body = json.dumps(completion(prompt="x" * (21 * 2**20))).encode()
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        content=body,
        timeout=TIMEOUT_S,
        headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"},
    )
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]


@pytest.mark.slow
def test_a_10_mb_prompt_stalls_no_stream(server, offline):
    """Regression: a 10 MB prompt was tokenized on the event loop; every stream stalled for seconds.

    Three prompts that fit the character bound (so they are tokenized) go in beside the
    stream: on the loop, the stream would stall for about three times what one takes to tokenize.
    """
    fitting = "x = 1\n" * (360_000 // 6)
    start = time.monotonic()
    offline.get_tokenizer().encode(fitting, add_special_tokens=False)
    one_tokenization_s = time.monotonic() - start
    client = server.async_client()

    async def stream_gaps() -> list[float]:
        stream = await client.completions.create(
            model="demo",
            prompt=PROMPT,
            max_tokens=120,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        times = [time.monotonic() async for _ in stream]
        return [b - a for a, b in zip(times, times[1:])]

    async def huge(prompt: str) -> openai.BadRequestError:
        await asyncio.sleep(0.5)  # once the stream is under way
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="demo", prompt=prompt, max_tokens=1)
        return info.value

    async def run() -> tuple[list[float], list[openai.BadRequestError]]:
        # 10 MB is rejected by its length alone; 360 kB fits the bound and is tokenized (off the loop) first.
        errors = asyncio.gather(huge("x = 1\n" * (10 * 2**20 // 6)), *(huge(fitting) for _ in range(3)))
        return await asyncio.gather(stream_gaps(), errors)

    gaps, (too_long, *too_many_tokens) = asyncio.run(run())
    assert "characters" in too_long.message and all("tokens" in e.message for e in too_many_tokens)
    limit_s = max(1.0, 2 * one_tokenization_s)
    assert max(gaps) < limit_s, (
        f"a stream stalled for {max(gaps):.1f} s (one tokenization: {one_tokenization_s:.1f} s)"
    )


# What each costs the server to parse and reject: the shapes of issue 26's stalls.
HUGE_BODIES = {
    "1M unknown fields to /tokenize": (
        "/tokenize",
        {"prompt": "x", **{f"k{i}": 0 for i in range(1_000_000)}},
        "999997 more",
    ),
    "1M unknown fields to /v1/completions": (
        "/v1/completions",
        {"prompt": "x", **{f"k{i}": 0 for i in range(1_000_000)}},
        "999997 more",
    ),
    "1M stop strings": ("/v1/completions", {"prompt": "x", "stop": ["ab"] * 1_000_000}, "stop"),
    "300k chat messages": (
        "/tokenize",
        {"messages": [{"role": "user", "content": "hi"}] * 300_000},
        "at most 10000",
    ),
    "2M token ids to /detokenize": ("/detokenize", {"tokens": [5] * 2_000_000}, None),
    "2M strings as token ids": ("/detokenize", {"tokens": ["5"] * 2_000_000}, "tokens"),
}


@pytest.mark.slow
def test_a_huge_body_stalls_nothing(server):
    """Regression: a body of 1M unknown keys held the event loop for 34 s (to /tokenize): the 400
    listed every field. Each body here is handled while /version is asked again and again:
    it must answer each time in under 2 s, and every error be short."""
    headers = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    bodies = {case: json.dumps(body).encode() for case, (_, body, _) in HUGE_BODIES.items()}

    async def run() -> tuple[float, dict[str, httpx.Response]]:
        done = asyncio.Event()
        async with httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=TIMEOUT_S) as http:

            async def worst_version_latency() -> float:
                worst = 0.0
                while not done.is_set():
                    start = time.monotonic()
                    with contextlib.suppress(httpx.TimeoutException):
                        await http.get("/version", timeout=10)
                    worst = max(worst, time.monotonic() - start)
                    await asyncio.sleep(0.05)
                return worst

            async def send_all() -> dict[str, httpx.Response]:
                try:
                    return {
                        case: await http.post(path, content=bodies[case])
                        for case, (path, _, _) in HUGE_BODIES.items()
                    }
                finally:
                    done.set()

            return await asyncio.gather(worst_version_latency(), send_all())

    worst, responses = asyncio.run(run())
    assert worst < 2.0, f"/version took {worst:.1f} s while a huge body was handled"
    for case, (_, _, word) in HUGE_BODIES.items():
        response = responses[case]
        if word is None:
            assert response.status_code == 200, (case, response.text[:300])
            continue
        message = response.json()["error"]["message"]
        assert response.status_code == 400 and word in message and len(message) < 1000, (case, message[:300])
    assert_idle(server)


def test_idle_connection_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        start = time.monotonic()
        assert s.recv(1) == b""  # the server hung up on a connection that never sent a request
        assert time.monotonic() - start < 20


def metric(server: ServeProcess, name: str) -> float:
    return server.metrics()[name]


def assert_idle(server: ServeProcess, within_s: float = 10) -> None:
    """Nothing running or waiting, no KV block held, no request state left in the frontend."""
    names = (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "nano_v1:frontend_requests",
    )
    deadline = time.monotonic() + within_s
    while any(metric(server, n) for n in names) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {n: metric(server, n) for n in names} == dict.fromkeys(names, 0.0)


@pytest.mark.slow
def test_mixed_soak_with_cancels(server):
    """A few hundred requests of every kind, some cancelled mid-stream: no failure, and idle at the end."""
    client = server.async_client()
    errors: list[str] = []

    async def one(i: int) -> None:
        kind = i % 6
        try:
            if kind == 0:  # streamed, cancelled after its first chunk
                stream = await client.completions.create(
                    model="demo",
                    prompt=f"x{i} = ",
                    max_tokens=200,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                async for _ in stream:
                    break
                await stream.close()
            elif kind == 1:
                r = await client.completions.create(
                    model="demo", prompt=f"def f{i}(", max_tokens=8, n=2, seed=i
                )
                assert len(r.choices) == 2
            elif kind == 2:
                r = await client.chat.completions.create(
                    model="demo",
                    messages=[{"role": "user", "content": f"task {i}"}],
                    max_tokens=8,
                    stream=True,
                    stop=["):"],
                )
                async for _ in r:
                    pass
            elif kind == 3:
                r = await client.completions.create(
                    model="demo", prompt=[5 + i % 40] * 20, max_tokens=6, logprobs=2
                )
                assert len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens
            elif kind == 4:  # bad, and must stay harmless
                with pytest.raises(openai.BadRequestError):
                    await client.completions.create(model="demo", prompt="x", max_tokens=2, seed=2**64)
            else:  # a client that gives up on a non-streamed request
                with pytest.raises(openai.APITimeoutError):
                    await client.with_options(timeout=0.3).completions.create(
                        model="demo", prompt=f"y{i}", max_tokens=400, extra_body={"ignore_eos": True}
                    )
        except Exception as e:  # noqa: BLE001 - every failure is collected and reported
            errors.append(f"{i} (kind {kind}): {e!r}")

    async def run() -> None:
        limit = asyncio.Semaphore(24)

        async def bounded(i: int) -> None:
            async with limit:
                await one(i)

        await asyncio.gather(*(bounded(i) for i in range(240)))

    asyncio.run(run())
    assert not errors, "\n".join(errors[:10])
    assert_idle(server)


@pytest.mark.slow
def test_port_taken_or_invalid_fails_at_once(server):
    """Regression: a taken port failed only after the model had loaded; --port 70000 printed a traceback."""
    taken = subprocess.run(
        [sys.executable, "-m", "nano_v1.entrypoints.cli", "serve", "--port", str(server.port)],
        env=server.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert taken.returncode != 0 and "cannot listen" in taken.stderr and "Traceback" not in taken.stderr
    assert "EngineCore process started" not in taken.stderr  # it stopped before loading anything
    invalid = subprocess.run(
        [sys.executable, "-m", "nano_v1.entrypoints.cli", "serve", "--port", "70000"],
        env=server.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert invalid.returncode == 2 and "70000" in invalid.stderr and "Traceback" not in invalid.stderr


@pytest.mark.slow
def test_killed_engine_core_fails_clients_and_the_server_exits(servers):
    """Regression: with its engine core dead the server answered 503s forever; now it exits, non-zero."""
    doomed = servers[1]
    client = openai.OpenAI(base_url=f"{doomed.base_url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
    stream = client.completions.create(
        model="doomed", prompt=PROMPT, max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    start = time.monotonic()
    os.kill(doomed.engine_core_pid(), signal.SIGKILL)
    with pytest.raises(openai.APIError, match="engine core"):
        for _ in stream:
            pass
    assert time.monotonic() - start < 10
    assert doomed.wait_exit(timeout_s=30) == 1
    assert time.monotonic() - start < 30
    assert "supervisor" in doomed.output() and "Traceback" not in doomed.output()
    assert os.listdir(doomed.tmpdir) == []


@pytest.mark.slow
def test_a_dead_tp_worker_is_named_in_the_clients_error():
    """Regression: a TP=2 worker killed mid-stream ended the stream with "the engine core hit an
    exception in its busy loop" while which worker had died, and how, was only in the log. Now
    the stream's error event, and the server's last line, say so."""
    tp = ServeProcess(*ENGINE_FLAGS, "--tensor-parallel-size", "2", "--disable-log-stats")
    try:
        tp.wait_healthy()
        core = psutil.Process(tp.engine_core_pid())
        killed = max(p.pid for p in core.children(recursive=True) if p.ppid() != core.pid)  # a worker
        client = openai.OpenAI(base_url=f"{tp.base_url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
        stream = client.completions.create(
            model="demo", prompt=PROMPT, max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        os.kill(killed, signal.SIGKILL)
        cause = rf"worker rank [01] \(pid {killed}\) was killed by signal 9 \(SIGKILL\)"
        with pytest.raises(openai.APIError, match=cause):
            for _ in stream:
                pass
        assert tp.wait_exit(timeout_s=30) == 1
        assert re.search(cause, tp.output().splitlines()[-1]), tp.output()[-3000:]
        assert os.listdir(tp.tmpdir) == []
    finally:
        tp.close()


def environ_of(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
        return {}


@pytest.mark.slow
def test_ctrl_c_while_the_model_loads_stops_cleanly():
    """Regression: Ctrl-C printed a traceback, and every exit left its temporary directories behind."""
    starting = ServeProcess(*ENGINE_FLAGS, "--disable-log-stats")
    try:
        deadline = time.monotonic() + 120
        while True:  # the port is bound before the model loads: once it accepts, the load is under way
            assert starting.proc.poll() is None, starting.output()[-3000:]
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", starting.port), 1):
                break
            assert time.monotonic() < deadline, "the port was never bound"
            time.sleep(0.05)
        starting.proc.send_signal(signal.SIGINT)
        assert starting.wait_exit(timeout_s=60) == 0
        assert "stopped" in starting.output() and "Traceback" not in starting.output()
        assert os.listdir(starting.tmpdir) == []
        # Whatever it had started by then (forkserver, engine core) inherited its TMPDIR.
        deadline = time.monotonic() + 10
        while left := [p for p in psutil.process_iter() if environ_of(p).get("TMPDIR") == starting.tmpdir]:
            assert time.monotonic() < deadline, f"left running: {left}"
            time.sleep(0.2)
    finally:
        starting.close()


@pytest.mark.slow
def test_second_ctrl_c_ends_open_streams_with_a_clean_error():
    """Regression: a second Ctrl-C during streams gave every client a 500 ("internal server error
    (ZMQError)") and logged a traceback per stream. Now each stream ends with a 503 saying the
    server is shutting down, and the log says so in one line."""
    stopping = ServeProcess(*ENGINE_FLAGS, "--disable-log-stats")
    try:
        stopping.wait_healthy()
        client = openai.AsyncOpenAI(
            base_url=f"{stopping.base_url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S
        )

        async def one(i: int, started: asyncio.Event) -> str:
            stream = await client.completions.create(
                model="demo", prompt=f"s{i} = ", max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
            )
            try:
                async for _ in stream:
                    started.set()
            except openai.APIError as e:
                return e.message
            return "finished"

        async def run() -> list[str]:
            events = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.create_task(one(i, e)) for i, e in enumerate(events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), TIMEOUT_S)
            stopping.proc.send_signal(signal.SIGINT)
            await asyncio.sleep(1.0)  # uvicorn waits for the streams ...
            stopping.proc.send_signal(signal.SIGINT)  # ... until told again
            return await asyncio.wait_for(asyncio.gather(*streams), TIMEOUT_S)

        messages = asyncio.run(run())
        assert all("shutting down" in m for m in messages), messages
        assert stopping.wait_exit(timeout_s=30) == 0
        output = stopping.output()
        assert output.count("Forced shutdown") == 1 and "Traceback" not in output, output[-3000:]
        assert os.listdir(stopping.tmpdir) == []
    finally:
        stopping.close()


@pytest.mark.slow
def test_sigterm_finishes_open_streams_and_leaves_nothing(server):
    """Last: SIGTERM. Regression: uvicorn re-raised it before the engine core was shut down, leaving
    `nano_v1_*` and `pymp-*` directories (and, on a kill, processes) behind."""
    client = server.async_client()

    async def one(i: int, on_first_chunk=None) -> tuple[int, str]:
        stream = await client.completions.create(
            model="demo",
            prompt=f"s{i} = ",
            max_tokens=48,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = reason = None
        async for chunk in stream:
            if on_first_chunk is not None:
                on_first_chunk()
                on_first_chunk = None
            for choice in chunk.choices:
                reason = choice.finish_reason or reason
            usage = chunk.usage.completion_tokens if chunk.usage else usage
        return usage, reason

    async def run() -> list[tuple[int, str]]:
        others = [asyncio.create_task(one(i)) for i in range(1, 4)]
        await asyncio.sleep(0.5)  # the others are streaming when the signal comes
        return await asyncio.gather(one(0, lambda: server.proc.send_signal(signal.SIGTERM)), *others)

    assert asyncio.run(run()) == [(48, "length")] * 4
    assert server.wait_exit(timeout_s=30) == 0
    assert "Traceback" not in server.output()
    assert os.listdir(server.tmpdir) == []
