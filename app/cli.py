"""`kvroute`: serve the routing API, print its OpenAPI document, run the simulated demo, or
tail an event stream."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvroute.app.config import ConfigError, load_settings

__all__ = ["main"]


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve", help="run the routing service",
        description="Follow vLLM instances' KV events and answer routing queries over HTTP. "
                    "Settings: defaults < --config file < KVROUTE_* environment < flags.")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to bind (default 8000)")
    serve.add_argument("--config", metavar="FILE", help="TOML configuration file")
    serve.add_argument("--instance", metavar="URL", action="append", default=[],
                       help="a vLLM instance's HTTP URL; repeat for several")
    serve.add_argument("--fleet", metavar="URL", action="append", default=[],
                       help="an HTTP URL whose host is a DNS name with one address per vLLM "
                            "instance (a Kubernetes headless Service): each address is "
                            "followed as an instance; repeat for several")
    serve.add_argument("--dns-refresh-seconds", type=float, metavar="SECONDS",
                       help="how often fleets' DNS names are resolved again (default 10)")
    serve.add_argument("--tokenizer", help='"instance" or a tokenizer.json path, for text '
                                           'prompts (with --proxy, default "instance")')
    serve.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--proxy", action="store_true", default=None,
                       help="also serve OpenAI-compatible /v1/completions, "
                            "/v1/chat/completions and /v1/models, forwarded to the chosen worker")
    serve.add_argument("--state-dir", metavar="DIR",
                       help="save the index here periodically and on shutdown, and resume "
                            "from it on start")
    serve.add_argument("--state-url", metavar="URL",
                       help="redis://HOST:PORT/N (Valkey or Redis): replicas share saved "
                            "state, placement guesses and load through it")
    serve.add_argument("--epp-port", type=int, metavar="PORT",
                       help="also answer as an Endpoint Picker (Envoy ext_proc gRPC, for the "
                            "Gateway API Inference Extension) on this port; 9002 by convention")
    serve.add_argument("--allow-unauthenticated", action="store_true", default=None,
                       help="serve without api_token/admin_token on a non-loopback address "
                            "(a trusted network only; tokens come from the config file or "
                            "KVROUTE_API_TOKEN / KVROUTE_ADMIN_TOKEN, never from flags)")


def _serve(args: argparse.Namespace) -> int:
    from kvroute.app.server import serve_forever

    flags = {"host": args.host, "port": args.port, "tokenizer": args.tokenizer,
             "log_level": args.log_level, "proxy": args.proxy,
             "allow_unauthenticated": args.allow_unauthenticated,
             "state_dir": args.state_dir, "state_url": args.state_url,
             "epp_port": args.epp_port,
             "instances": [{"url": url} for url in args.instance] or None,
             "fleets": [{"url": url} for url in args.fleet] or None,
             "dns_refresh_seconds": args.dns_refresh_seconds}
    settings = load_settings(args.config, flags=flags)
    from kvroute.app.fleet.limits import raise_open_files

    raise_open_files(settings)  # a fleet too large for the process: one line, exit 2
    # log_level governs kvroute's own loggers too (debug: every proxy decision's scores).
    logging.getLogger("kvroute").setLevel(settings.log_level.upper())
    return serve_forever(settings)


def _add_openapi(subparsers: argparse._SubParsersAction) -> None:
    openapi = subparsers.add_parser(
        "openapi", help="print the HTTP API's OpenAPI document",
        description="Print the OpenAPI 3.1 document (JSON). Without --config: the reference "
                    "document (docs/openapi.json): every endpoint, tokens required, default "
                    "limits. With --config: the document `kvroute serve --config FILE` "
                    "serves at /openapi.json (the KVROUTE_* environment applies too).")
    openapi.add_argument("--config", metavar="FILE", help="TOML configuration file")
    openapi.add_argument("--markdown", action="store_true",
                         help="print docs/api.md's table of operations instead")


def _openapi(args: argparse.Namespace) -> int:
    from kvroute.app.http.app import create_app
    from kvroute.app.http.openapi import (
        markdown_table,
        openapi_document,
        reference_settings,
        render,
    )

    settings = reference_settings() if args.config is None else load_settings(args.config)
    document = openapi_document(create_app(settings), settings)
    sys.stdout.write(markdown_table(document) if args.markdown else render(document))
    return 0


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo", help="run kvroute against a built-in simulated vLLM cluster",
        description="Starts simulated vLLM instances on loopback, registers them with a "
                    "kvroute service, drives a small workload and prints a live summary.")
    demo.add_argument("--port", type=int, default=8000, help="kvroute's port (default 8000)")
    demo.add_argument("--instances", type=int, default=4, help="simulated instances (default 4)")
    demo.add_argument("--duration", type=float, default=None,
                      help="stop after this many seconds (default: run until Ctrl-C)")
    demo.add_argument("--seed", type=int, default=0, help="workload seed")


def _demo(args: argparse.Namespace) -> int:
    from kvroute.sim.demo import run_demo

    return run_demo(port=args.port, instances=args.instances, duration=args.duration,
                    seed=args.seed)


def _parser() -> argparse.ArgumentParser:
    from kvroute.app.ingest import tail

    parser = argparse.ArgumentParser(prog="kvroute",
                                     description="KV-cache-aware routing for vLLM fleets")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(subparsers)
    _add_openapi(subparsers)
    _add_demo(subparsers)
    tail.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per outgoing request (discovery, /tokenize) drowns everything else.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "demo":
            return _demo(args)
        if args.command == "openapi":
            return _openapi(args)
        from kvroute.app.ingest import tail

        return tail.run(args)
    except ConfigError as exc:
        print(f"kvroute: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
