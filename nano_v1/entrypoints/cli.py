"""The `nano-v1` command: `generate`, `serve`, and `bench throughput | scheduler | serve | processes | spec`.

Mirrors vllm/entrypoints/cli/ (chapters 01 and 09).

Engine flags come from `EngineArgs.add_cli_args`, so the CLI and `LLM(**kwargs)` accept
the same names (`--max-num-seqs` is `max_num_seqs`), as in vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys

from nano_v1.engine.arg_utils import EngineArgs


def _generate(args: argparse.Namespace) -> None:
    from nano_v1 import LLM, SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**dataclasses.asdict(engine_args))
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.sampling_seed, max_tokens=args.max_tokens,
    )
    outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, output in zip(args.prompt, outputs):
        for completion in output.outputs:
            print(prompt + completion.text)
            print("-" * 40)


def _serve(args: argparse.Namespace) -> None:
    """Serve until SIGINT/SIGTERM (exit 0, open requests finished) or the engine core's death (exit 1)."""
    from nano_v1.engine.exceptions import EngineDeadError
    from nano_v1.entrypoints.openai.api_server import install_signal_handlers, run_server

    if args.model_tag is not None:
        args.model = args.model_tag
    _log_to_stderr()
    install_signal_handlers()
    try:
        asyncio.run(run_server(args))
    except KeyboardInterrupt:
        print("nano-v1 serve: stopped.", file=sys.stderr)
    except EngineDeadError as e:
        print(f"nano-v1: error: {e}. The server stopped, for a supervisor to restart it.", file=sys.stderr)
        sys.exit(1)


def _log_to_stderr() -> None:
    """nano_v1's INFO messages (the periodic stats line among them) on stderr, in vLLM's format."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
                                           datefmt="%m-%d %H:%M:%S"))
    nano_logger = logging.getLogger("nano_v1")
    nano_logger.addHandler(handler)
    nano_logger.setLevel(logging.INFO)


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535)")
    return port


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="nano-v1", description="nano_v1: an annotated vLLM v1.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts with a model (default: the bundled demo model)")
    gen.add_argument("prompt", nargs="+", help="one or more prompts")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("-n", "--n", type=int, default=1)
    gen.add_argument("--sampling-seed", type=int, default=None)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=_generate)

    server = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (default: the bundled demo model)")
    server.add_argument("model_tag", nargs="?", default=None, help="checkpoint directory (same as --model)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=_port, default=8000)
    server.add_argument("--served-model-name", default=None,
                        help="the name clients pass as `model` (default: the model as given, or 'demo')")
    server.add_argument("--api-key", nargs="+", default=None,
                        help="require 'Authorization: Bearer <one of these>' on /v1 (default: VLLM_API_KEY)")
    server.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line in the log")
    server.add_argument("--max-request-body-bytes", type=int, default=None,
                        help="requests with a larger body get a 413 (default: 32 MiB)")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="usage reports prompt_tokens_details.cached_tokens (prefix cache and KV connector hits)")
    EngineArgs.add_cli_args(server)
    server.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks (each prints ratios against a peer and writes JSON)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from nano_v1.benchmarks import processes, scheduler_overhead, serve, spec_decode, throughput

    for module in (throughput, scheduler_overhead, serve, processes, spec_decode):
        p = bench_sub.add_parser(module.NAME, help=module.__doc__.splitlines()[0])
        module.add_cli_args(p)
        if module.USES_ENGINE_ARGS:
            EngineArgs.add_cli_args(p)
        p.set_defaults(func=module.main)

    args = parser.parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:
        print(f"nano-v1: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
