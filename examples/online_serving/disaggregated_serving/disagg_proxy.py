"""A proxy for disaggregated serving: every request is prefilled on one server and decoded on another.

Mirrors v0.11.0's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, the proxy
v0.11.0's examples/online_serving/disaggregated_serving/ README points to (chapter 16).

Start a prefill server (`kv_producer`) and a decode server (`kv_consumer`) over the same
shared storage, then this proxy, from the repository root:

    nano-v1 serve --port 8100 --kv-transfer-config \\
        '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}'
    nano-v1 serve --port 8200 --kv-transfer-config \\
        '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer",
          "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}'
    python -m examples.online_serving.disaggregated_serving.disagg_proxy --port 8000 \\
        --prefiller-url http://127.0.0.1:8100 --decoder-url http://127.0.0.1:8200

and send OpenAI requests to port 8000. For each `/v1/completions` or `/v1/chat/completions`
request the proxy:

1. sends it to the prefill server with `max_tokens=1`, no streaming, and
   `kv_transfer_params={"do_remote_decode": True, ...}`: the prefill server computes the
   prompt's KV, and its connector saves it (SharedStorageConnector: as files);
2. sends the original request to the decode server, with the `kv_transfer_params` the
   prefill's response carries, if any (a connector that sends KV over the network names
   the blocks there; SharedStorageConnector finds the files by the prompt and needs none).
   The decode server's connector loads the saved KV, so it computes only the rest of the
   prompt before it decodes;
3. returns the decode server's answer as it comes, byte for byte, streamed or not.

An error from either server (a 400 for a bad request, a 503 from a dead engine) is
returned with its status and body: the client sees what a single server would answer.

What differs from v0.11.0's toy proxy: one prefill and one decode server (no round robin),
given by URL; errors are passed through instead of raised (v0.11.0's proxy answers 500);
`min_tokens` is left out of the prefill request, which makes only one token; the client's
Authorization header goes to both servers (v0.11.0's sends $OPENAI_API_KEY).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

# What the proxy asks the prefill server's connector for (NixlConnector's spelling, as the
# toy proxy's): keep the KV for a remote decode; the remote fields are the decode's to fill.
PREFILL_KV_TRANSFER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def build_app(prefiller_url: str, decoder_url: str) -> FastAPI:
    """The proxy's routes over one prefill and one decode server, each an OpenAI server's base URL."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # No timeout: a long completion may stream for minutes.
        async with httpx.AsyncClient(base_url=prefiller_url, timeout=None) as prefill_client, \
                httpx.AsyncClient(base_url=decoder_url, timeout=None) as decode_client:  # fmt: skip
            app.state.prefill_client, app.state.decode_client = prefill_client, decode_client
            yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle_request("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle_request("/v1/chat/completions", request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def prefill_request(req_data: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill server gets: the client's, making one token, whole, for a remote decode."""
    prefill_data = {**req_data, "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS, "stream": False, "max_tokens": 1}
    if "max_completion_tokens" in prefill_data:
        prefill_data["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens"):  # a whole response; no more than its one token
        prefill_data.pop(key, None)
    return prefill_data


def passed_through(response: httpx.Response) -> Response:
    """A server's whole response, status and body as they are."""
    return Response(response.content, response.status_code, media_type=response.headers.get("content-type"))


async def handle_request(path: str, request: Request) -> Response:
    """Prefill on one server, then decode on the other; return the decode server's answer as it streams."""
    body, headers = await request.body(), _headers(request)
    prefill_client: httpx.AsyncClient = request.app.state.prefill_client
    try:
        req_data = json.loads(body)
    except ValueError:  # json.JSONDecodeError, UnicodeDecodeError
        req_data = None
    if not isinstance(req_data, dict):
        # Not a JSON object: the prefill server says what is wrong with it, in OpenAI's shape.
        return passed_through(await prefill_client.post(path, content=body, headers=headers))
    prefill = await prefill_client.post(path, json=prefill_request(req_data), headers=headers)
    if prefill.is_error:
        return passed_through(prefill)
    if kv_transfer_params := prefill.json().get("kv_transfer_params"):
        req_data = {**req_data, "kv_transfer_params": kv_transfer_params}
    decode_client: httpx.AsyncClient = request.app.state.decode_client
    decode = await decode_client.send(decode_client.build_request("POST", path, json=req_data, headers=headers), stream=True)
    if decode.is_error:
        await decode.aread()
        await decode.aclose()
        return passed_through(decode)

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in decode.aiter_raw():
                yield chunk
        finally:  # also when the client leaves: closing the stream aborts the decode server's request
            await decode.aclose()

    return StreamingResponse(relay(), decode.status_code, media_type=decode.headers.get("content-type"))


def _headers(request: Request) -> dict[str, str]:
    """The client's headers the servers need: its API key, if it sent one."""
    return {"authorization": request.headers["authorization"]} if "authorization" in request.headers else {}


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefiller-url", default="http://127.0.0.1:8100", help="the prefill server (kv_producer)")
    parser.add_argument("--decoder-url", default="http://127.0.0.1:8200", help="the decode server (kv_consumer)")
    args = parser.parse_args()
    uvicorn.run(build_app(args.prefiller_url, args.decoder_url), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
