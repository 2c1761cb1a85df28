"""`scriptserve`: archive tools and in-process prediction.

scriptserve archive create|inspect|verify ...
scriptserve predict ARCHIVE --input FILE.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from archiver.archive import open_archive
from archiver.cli import USER_ERRORS, add_archive_subcommands, fail, run_archive_command
from handlers.backends import BackendError
from handlers.base import Context, HandlerError, InferenceRequest
from handlers.loader import load_handler, read_model_config


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
        (response,) = handler.handle(
            [InferenceRequest(body=body, content_type="application/json")], context
        )
    if response.error is not None:
        raise HandlerError(response.error, response.status)
    if response.body is not None:
        return response.body
    return {name: tensor.tolist() for name, tensor in response.outputs.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scriptserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "archive":
        return run_archive_command(args, "scriptserve archive")
    try:
        result = predict(args.archive, args.input, args.device)
    except (*USER_ERRORS, HandlerError, BackendError) as exc:
        fail("scriptserve predict", str(exc))
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0
