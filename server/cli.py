"""`scriptserve`: serve models, build and check archives, predict in-process.

- `scriptserve serve --model-store DIR --models all`
- `scriptserve archive create|inspect|verify ...`
- `scriptserve predict ARCHIVE --input FILE.json`
- `scriptserve train ...` (runs `python -m scriptserve.training ...`)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from scriptserve.archiver.archive import open_archive
from scriptserve.archiver.cli import USER_ERRORS, add_archive_subcommands, fail, run_archive_command
from scriptserve.handlers.backends import BackendError
from scriptserve.handlers.base import Context, HandlerError, InferenceRequest
from scriptserve.handlers.loader import load_handler, read_model_config, worker_scope
from scriptserve.server.settings import load_settings


def predict(archive: Path, input_file: Path, device: str) -> object:
    """Run one request through the archive's handler in this process; return its JSON answer."""
    body = input_file.read_bytes()
    with open_archive(archive) as reader:
        manifest = reader.manifest
        context = Context(
            model_name=manifest.model.model_name,
            model_version=manifest.model.model_version,
            model_dir=reader.root,
            manifest=manifest,
            model_config=read_model_config(reader.root, manifest),
            device=device,
        )
        handler = load_handler(context)
        with worker_scope(handler):
            (response,) = handler.handle(
                [InferenceRequest(body=body, content_type="application/json")], context
            )
    if response.error is not None:
        raise HandlerError(response.error, response.status)
    if response.body is not None:
        return response.body
    return {name: tensor.tolist() for name, tensor in response.outputs.items()}


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Command-line settings; each overrides the YAML file and SCRIPTSERVE_* variables."""
    p.add_argument("--config", type=Path, help="YAML settings file")
    p.add_argument(
        "--ts-config",
        type=Path,
        help="TorchServe config.properties to take settings from (below --config)",
    )
    p.add_argument("--model-store", type=Path, help="directory of archives (default ./model_store)")
    p.add_argument("--models", nargs="+", help="all | NAME=FILE | FILE ... (default all)")
    p.add_argument("--inference-address", help="HOST:PORT (default 127.0.0.1:8080)")
    p.add_argument("--management-address", help="HOST:PORT (default 127.0.0.1:8081)")
    p.add_argument("--metrics-address", help="HOST:PORT (default 127.0.0.1:8082)")
    p.add_argument("--grpc-inference-address", help="HOST:PORT (default 127.0.0.1:7070)")
    p.add_argument("--grpc-management-address", help="HOST:PORT (default 127.0.0.1:7071)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--workers", dest="workers_per_model", type=int, help="workers per model")
    p.add_argument("--intra-op-threads", type=int, help="threads per worker's model call")
    p.add_argument("--max-batch-size", type=int)
    p.add_argument("--max-batch-delay", dest="max_batch_delay_ms", type=float, help="milliseconds")
    p.add_argument("--queue-size", type=int, help="waiting requests per model before 503")
    p.add_argument("--response-timeout", dest="response_timeout_s", type=float, help="seconds")
    p.add_argument("--drain-timeout", dest="drain_timeout_s", type=float, help="seconds")
    p.add_argument(
        "--worker-mode", choices=["thread", "process"], help="default worker kind (thread)"
    )
    p.add_argument(
        "--enable-model-api",
        action="store_true",
        default=None,
        help="allow register/unregister through the management API",
    )
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        default=None,
        help="check no key on any API, even beyond loopback (behind an authenticating proxy only)",
    )
    p.add_argument(
        "--no-snapshot",
        dest="restore_snapshot",
        action="store_false",
        default=None,
        help="do not restore the models of the last snapshot",
    )
    p.add_argument("--key-file", type=Path, help="where keys generated at start are written")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


_SERVE_KEYS = (
    "model_store", "models", "inference_address", "management_address", "metrics_address",
    "grpc_inference_address", "grpc_management_address",
    "device", "workers_per_model", "intra_op_threads", "max_batch_size", "max_batch_delay_ms",
    "queue_size", "response_timeout_s", "drain_timeout_s", "enable_model_api", "log_level",
    "worker_mode", "insecure_no_auth", "restore_snapshot", "key_file", "ts_config",
)  # fmt: skip


def serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from scriptserve.server.app import StartupError, run
    from scriptserve.server.security import SecurityConfigError

    try:
        settings = load_settings(args.config, **{k: getattr(args, k) for k in _SERVE_KEYS})
    except (ValidationError, ValueError) as exc:
        fail("scriptserve serve", f"invalid settings: {exc}")
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if settings.ts_config is not None:
        from scriptserve.server.tsconfig import report_ts_config

        report_ts_config(settings.ts_config)
    try:
        return run(settings)
    except SecurityConfigError as exc:
        # Exit 2, as for a usage error: the command line or settings must change.
        print(f"scriptserve serve: error: {exc}", file=sys.stderr)
        return 2
    except StartupError as exc:
        fail("scriptserve serve", str(exc))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scriptserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve", help="serve the models of a model store"))
    add_archive_subcommands(sub.add_parser("archive", help="create, inspect or verify archives"))
    p = sub.add_parser("predict", help="run one prediction in-process and print it as JSON")
    p.add_argument("archive", type=Path)
    p.add_argument(
        "--input",
        required=True,
        type=Path,
        help="JSON input: an array (one instance of the single input) or {name: instance}",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    sub.add_parser(
        "train",
        add_help=False,
        help="train a digits model into archives (python -m scriptserve.training; see its --help)",
    )
    return parser


def train(args: Sequence[str]) -> int:
    """Replace this process with `python -m scriptserve.training ARGS` (the server never imports
    the training package)."""
    os.execv(sys.executable, [sys.executable, "-m", "scriptserve.training", *args])
    return 1  # not reached: execv returns only by raising OSError


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        return train(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "archive":
        return run_archive_command(args, "scriptserve archive")
    if args.command == "serve":
        return serve(args)
    try:
        result = predict(args.archive, args.input, args.device)
    except (*USER_ERRORS, HandlerError, BackendError) as exc:
        fail("scriptserve predict", str(exc))
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0
