"""`scriptserve`: serve models, build and check archives, predict in-process.

- `scriptserve serve --model-store DIR --models all`
- `scriptserve archive create|inspect|verify ...`
- `scriptserve predict ARCHIVE --input FILE.json`
- `scriptserve train ...` (runs `python -m scriptserve.training ...`)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import SecretStr
from pydantic.fields import FieldInfo

from scriptserve import __version__
from scriptserve.archiver.archive import open_archive
from scriptserve.archiver.cli import (
    USER_ERRORS,
    add_archive_subcommands,
    fail,
    report_crashes,
    run_archive_command,
)
from scriptserve.handlers.backends import BackendError
from scriptserve.handlers.base import Context, HandlerError, InferenceRequest, run_batch
from scriptserve.handlers.loader import load_handler, read_model_config, worker_scope
from scriptserve.server.observability.log_format import configure_logging
from scriptserve.server.settings import FlagAliases, ServerSettings, load_settings


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
            request = InferenceRequest(body=body, content_type="application/json")
            (response,) = run_batch(handler, [request], context)
    if response.error is not None:
        raise HandlerError(response.error, response.status)
    if response.body is not None:
        return response.body
    return {name: tensor.tolist() for name, tensor in response.outputs.items()}


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per ServerSettings field: `--its-name` (plus its FlagAliases), typed from its
    annotation, its docstring as help. A flag given overrides the YAML file and `SCRIPTSERVE_*`
    variables; one left out is None here and leaves them be."""
    for name, field in ServerSettings.model_fields.items():
        options = _flag_options(name, field)
        if options is None:
            continue
        aliases = [
            f for meta in field.metadata if isinstance(meta, FlagAliases) for f in meta.flags
        ]
        p.add_argument(f"--{name.replace('_', '-')}", *aliases, dest=name, default=None, **options)


_METAVARS: dict[type, str] = {str: "TEXT", int: "N", float: "N", Path: "PATH"}


def _flag_options(name: str, field: FieldInfo) -> dict[str, Any] | None:
    """add_argument's options for a setting; None for a secret, which a command line would show
    to every user of the machine (`ps`): keys come from the environment or a key file."""
    kind = _without_none(field.annotation)
    if kind is SecretStr:
        return None
    options: dict[str, Any] = {"help": _help(name, field)}
    if kind is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif get_origin(kind) is Literal:
        options["choices"] = get_args(kind)
    elif get_origin(kind) is list:
        options.update(nargs="+", type=get_args(kind)[0])
    elif get_origin(kind) is dict:
        options.update(type=_json_object, metavar="JSON")
    elif kind in _METAVARS:
        metavar = "HOST:PORT" if name.endswith("_address") else _METAVARS[kind]
        # Paths stay text until the settings read them: Path() would make `s3://b/k` `s3:/b/k`.
        options.update(type=str if kind is Path else kind, metavar=metavar)
    else:
        raise TypeError(f"setting {name}: no command-line form for {kind!r}")
    return options


def _without_none(annotation: Any) -> Any:
    """`X | None` -> X."""
    if get_origin(annotation) in (Union, UnionType):
        kinds = [a for a in get_args(annotation) if a is not type(None)]
        if len(kinds) == 1:
            return kinds[0]
    return annotation


def _help(name: str, field: FieldInfo) -> str:
    """The field's docstring on one line, and its default."""
    text = " ".join((field.description or "").split()).replace("%", "%%")
    default = field.get_default(call_default_factory=True)
    if isinstance(default, list):
        default = " ".join(default)
    elif isinstance(default, bool):
        default = f"--{'' if default else 'no-'}{name.replace('_', '-')}"
    if default in (None, "", {}):
        return text
    return f"{text} (default: {default})" if text else f"default: {default}"


def _json_object(value: str) -> dict[str, Any]:
    try:
        data = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return data


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The settings tree with the `serve` flags given on top; raises SettingsError."""
    given = {k: v for k, v in vars(args).items() if k in ServerSettings.model_fields}
    return load_settings(**given)


def serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    try:
        settings = settings_from_args(args)
    except (ValidationError, ValueError) as exc:
        fail("scriptserve serve", f"invalid settings: {exc}")
    if settings.worker_mode == "process":
        from scriptserve.server.workers.process import fork_server

        fork_server.start()  # its imports run beside the server's own
    from scriptserve.server.app import ModelStoreError, StartupError, run
    from scriptserve.server.security import SecurityConfigError

    # Every logger, uvicorn's and grpc's included, ends at this handler: control characters a
    # client sent (a newline in a model name or request id) are escaped, never a new line.
    configure_logging(settings.log_level, settings.log_format)
    if settings.ts_config is not None:
        from scriptserve.server.models.torchserve_config import report_torchserve_config

        report_torchserve_config(settings.ts_config, os.environ)
    try:
        return run(settings)
    except (SecurityConfigError, ModelStoreError) as exc:
        # Exit 2, as for a usage error: the command line or settings must change.
        print(f"scriptserve serve: error: {exc}", file=sys.stderr)
        return 2
    except StartupError as exc:
        fail("scriptserve serve", str(exc))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scriptserve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"scriptserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # No abbreviations: `--management-key` must not be taken for `--management-key-file`, and
    # an abbreviation that works today would break when a setting is added.
    serve_parser = sub.add_parser(
        "serve", help="serve the models of a model store", allow_abbrev=False
    )
    add_serve_arguments(serve_parser)
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
    if argv is None:  # the command itself, not a call from Python
        report_crashes()
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
