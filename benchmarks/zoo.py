"""The zoo's models (examples/zoo.py) in every format scriptserve serves, on one machine, in one
run: items/s in-process (the backend a worker calls, 2 threads) for `.pt2` fp32, int8 and
bf16 (where the CPU has AVX512-BF16 or AMX), TorchScript and ONNX; OpenVINO's in-process
figures on the same model (its default precision, and bf16 where the CPU has it) as the anchor
to beat; and the `.pt2` archives served over HTTP (items/s, p50, p99). Each figure is also
given as a fraction of the machine's measured peak (a GEMM microbenchmark, fp32 and int8).
GPT-2's items are tokens: in process, next-token logits of 8 texts of 128 tokens; served, the
tokens of greedy continuations (`GENERATED_TOKENS` per request), for both servers.

    python -m benchmarks.zoo                         # every model, full size (minutes each)
    python -m benchmarks.zoo --models bert --size small --seconds 3

Needs `pip install openvino` for the OpenVINO column (left out without it) and TorchServe 0.12
with Java for its served column (`benchmarks/torchserve.py`); the served load is 8, then 32
keep-alive clients of one request each (`loadgen.steady_load`), for both servers. Results:
benchmarks/results/zoo-<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import torchserve
from benchmarks.loadgen import STEADY_WARMUP_S, steady_load
from benchmarks.report import cpu_line, write_results
from benchmarks.servers import scriptserve
from examples.zoo import ZOO, Built, build, built_in, greedy_continuation
from scriptserve.archiver.archive import open_archive
from scriptserve.archiver.cli import model_archiver_main
from scriptserve.archiver.precision import precision_isa
from scriptserve.archiver.pt2_check import call_model
from scriptserve.handlers.backends import load_backend

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / "build" / "zoo"
TEXT_TOKENS = 128
"""Tokens per text in the in-process runs (padded): BERT-base's usual serving length."""
Runner = Callable[[], None]


# -- the machine's peak ------------------------------------------------------------------------
def _rate(call: Runner, seconds: float) -> float:
    """Calls per second of `call` on two threads, each running it for `seconds`."""
    counts = [0, 0]
    stop = time.perf_counter() + seconds

    def loop(i: int) -> None:
        torch.set_num_threads(1)
        while time.perf_counter() < stop:
            call()
            counts[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / seconds


def gemm_peak(seconds: float) -> dict[str, float]:
    """GFLOP/s of fp32 matrix multiplies (torch.mm: MKL/oneDNN) and GOP/s of int8 ones (a
    dynamically quantized Linear: fbgemm's u8 x s8 kernels, VNNI where the CPU has it); two
    threads, 2048 x 2048 x 2048 each, large enough that packing and threading are amortised."""
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    linear = torch.ao.nn.quantized.dynamic.Linear(n, n)
    linear.set_weight_bias(
        torch.quantize_per_tensor(torch.randn(n, n), 0.05, 0, torch.qint8), torch.zeros(n)
    )
    fp32 = _rate(lambda: torch.mm(a, b), seconds) * 2 * n**3 / 1e9
    int8 = _rate(lambda: linear(a), seconds) * 2 * n**3 / 1e9
    return {"fp32_gflops": fp32, "int8_gops": int8}


# -- the models ---------------------------------------------------------------------------------
def files(name: str, size: str) -> Built:
    root = WORK / size / name
    if (root / "weights.pt").is_file():
        return built_in(name, root)
    return build(name, root, size=size)


def fresh(path: Path, built: Built) -> bool:
    """Whether `path` (an archive, a traced or exported file) was made from the model's current
    weights: it exists and is newer. A rebuilt model is archived and converted again."""
    return path.is_file() and path.stat().st_mtime >= built.weights.stat().st_mtime


def archive(built: Built, label: str, store: Path, *extra: str) -> Path | str:
    """The archive, or model-archiver's reason for refusing it (an int8 model its accuracy
    guard refused, say): the benchmark reports it and goes on. An archive in `store` newer than
    the model's weights is reused."""
    path = store / f"{label}.mar"
    if fresh(path, built):
        return path
    argv = built.archiver_args(label, store, "--max-batch", "32", *extra)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
            model_archiver_main(argv)
    except SystemExit:
        lines = [ln for ln in errors.getvalue().splitlines() if "error:" in ln]
        return lines[-1] if lines else f"model-archiver failed for {label}"
    return path


def batch_inputs(built: Built, batch: int) -> dict[str, np.ndarray]:
    """`batch` rows of the validation samples; texts as TEXT_TOKENS real tokens each (the
    model's bound where it is lower): their own tokens, repeated."""
    with np.load(built.validation) as data:
        inputs = {n: data[n][:batch] for n in data.files}
    if built.model.kind != "text":
        return inputs
    config = json.loads((built.root / "config.json").read_text())
    bound = config.get("max_position_embeddings") or config.get("n_positions") or TEXT_TOKENS
    tokens = min(TEXT_TOKENS, int(bound))
    rows = [
        row[mask != 0]
        for row, mask in zip(inputs["input_ids"], inputs["attention_mask"], strict=True)
    ]
    ids = np.stack([np.resize(row, tokens) for row in rows]).astype(np.int64)
    made = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": 0 * ids}
    return {n: made[n] for n in inputs}


def eager_model(built: Built) -> Any:
    from scriptserve.archiver.model_source import load_eager_model

    return load_eager_model(built.model_file, built.weights, built.model.model_class)


def flops_per_item(built: Built, inputs: Mapping[str, np.ndarray]) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    one = {n: a[:1] for n, a in inputs.items()}
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        call_model(eager_model(built), one)
    return float(counter.get_total_flops())


def torchscript_file(built: Built, inputs: Mapping[str, np.ndarray]) -> Path:
    path = built.root / f"{built.model.name}.pt"
    if not fresh(path, built):
        example = {n: torch.from_numpy(a[:2]) for n, a in inputs.items()}
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.jit.trace(eager_model(built), example_kwarg_inputs=example, strict=False).save(
                str(path)
            )
    return path


def onnx_file(built: Built, inputs: Mapping[str, np.ndarray]) -> Path:
    path = built.root / f"{built.model.name}.onnx"
    if not fresh(path, built):
        names = list(inputs)
        text = built.model.kind == "text"
        axes = {n: {0: "batch", 1: "seq"} if text else {0: "batch"} for n in names}
        example = {n: torch.from_numpy(a[:2]) for n, a in inputs.items()}
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                eager_model(built),
                (),
                str(path),
                kwargs=example,
                input_names=names,
                output_names=["output0"],
                dynamic_axes={**axes, "output0": {0: "batch"}},
                dynamo=False,
            )
    return path


def backend_rate(path: Path, fmt: str, inputs: Mapping[str, np.ndarray], seconds: float) -> float:
    """Items/s of the backend a worker uses (2 threads, one intra-op thread each)."""
    manifest = None
    if fmt == "pt2":
        with open_archive(path) as reader:
            manifest = reader.manifest
            package = reader.root / str(manifest.model.serialized_file)
            backend = load_backend(package, "pt2", manifest=manifest, workers=2)
            backend.run(inputs)
            return _rate(lambda: backend.run(inputs), seconds) * _rows(inputs)
    backend = load_backend(path, fmt, intra_op_threads=1, options={}, workers=2)  # type: ignore[arg-type]
    backend.run(inputs)
    return _rate(lambda: backend.run(inputs), seconds) * _rows(inputs)


def _rows(inputs: Mapping[str, np.ndarray]) -> int:
    return int(next(iter(inputs.values())).shape[0])


def openvino_rates(
    built: Built, inputs: Mapping[str, np.ndarray], seconds: float
) -> dict[str, float]:
    """Items/s of OpenVINO on the same model, 2 requests in flight: at its default precision for
    this CPU ("OpenVINO"), and in bfloat16 ("OpenVINO bf16") where the CPU has AVX512-BF16 or
    AMX and the default is not already bf16; nothing without openvino installed."""
    try:
        import openvino as ov
    except ImportError:
        return {}
    example = {n: torch.from_numpy(a) for n, a in inputs.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = ov.convert_model(eager_model(built), example_input=example)
    core = ov.Core()
    rates = {"OpenVINO": _openvino_rate(core, converted, inputs, seconds, {})}
    default = str(core.get_property("CPU", "INFERENCE_PRECISION_HINT"))
    if precision_isa() is not None and "bf16" not in default:
        hint = {"INFERENCE_PRECISION_HINT": "bf16"}
        rates["OpenVINO bf16"] = _openvino_rate(core, converted, inputs, seconds, hint)
    return rates


def _openvino_rate(
    core: Any,
    converted: Any,
    inputs: Mapping[str, np.ndarray],
    seconds: float,
    config: Mapping[str, str],
) -> float:
    import openvino as ov

    compiled = core.compile_model(
        converted,
        "CPU",
        {"PERFORMANCE_HINT": "THROUGHPUT", "INFERENCE_NUM_THREADS": 2, **config},
    )
    queue = ov.AsyncInferQueue(compiled, 2)
    feed = list(inputs.values())
    done = 0

    def finished(request: Any, userdata: Any) -> None:
        nonlocal done
        done += 1

    queue.set_callback(finished)
    for _ in range(4):
        queue.start_async(feed)
    queue.wait_all()
    done = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        queue.start_async(feed)
    queue.wait_all()
    return done * _rows(inputs) / (time.perf_counter() - started)


# -- served ---------------------------------------------------------------------------------
PROMPT = "the quick brown fox jumps over the lazy dog"
GENERATED_TOKENS = 16
"""What a client asks a generator for: the continuation of PROMPT, this many tokens long (it
has no end-of-text token before them: `generated_tokens` checks). A generator's items are the
tokens it makes: a request counts GENERATED_TOKENS."""


def generates(built: Built) -> bool:
    return built.model.handler == "text_generator"


def request_body(built: Built, directory: Path) -> tuple[Path, dict[str, str]]:
    """What one client request sends: a 320x240 JPEG, a text of about 90 tokens, or for a
    generator a prompt and how many tokens to make."""
    body = directory / "body"
    if built.model.kind == "image":
        from PIL import Image

        Image.new("RGB", (320, 240), (120, 80, 200)).save(body, format="JPEG")
        return body, {"Content-Type": "image/jpeg"}
    if generates(built):
        body.write_text(json.dumps({"text_input": PROMPT, "max_tokens": GENERATED_TOKENS}))
        return body, {"Content-Type": "application/json"}
    body.write_text("the quick brown fox jumps over the lazy dog " * 10)
    return body, {"Content-Type": "text/plain"}


def generated_tokens(built: Built) -> int:
    """Tokens a served request makes: GENERATED_TOKENS for a generator, whose eager greedy
    continuation of PROMPT is checked to reach that length (a served figure counts them); 1
    item for every other model."""
    if not generates(built):
        return 1
    if built.root not in _CHECKED:
        _CHECKED[built.root] = _greedy_length(built)
    return _CHECKED[built.root]


_CHECKED: dict[Path, int] = {}


def _greedy_length(built: Built) -> int:
    continuation = greedy_continuation(built, eager_model(built), PROMPT, GENERATED_TOKENS)
    if continuation.ended:
        raise RuntimeError(f"{built.model.name} ends {PROMPT!r} before {GENERATED_TOKENS}")
    return continuation.tokens


SHAPES = ((2, 1, 32, 0), (1, 2, 32, 0), (2, 1, 8, 0), (2, 1, 8, 5), (1, 2, 8, 5))
"""The serving shapes tried for each archive, (workers, intra-op threads each, max batch size,
max batch delay in ms), as TorchServe is tried at several (`torchserve.best_rate`): two
single-threaded workers suit a model whose batches are cheap, one worker on both cores one whose
rate needs large batches; with no delay a worker takes what is queued, with TorchServe's own
settings (batch 8, 5 ms) it waits a little for the batch to fill. An int8 convolution net runs
8 rows at a time far faster than twice 4, so batches capped at 8 suit it once enough clients
keep a full batch queued for each worker (`torchserve.CONNECTIONS`)."""
GENERATOR_SHAPES = ((2, 1, 8, 5), (1, 2, 8, 5))
"""A generator's shapes: a request is GENERATED_TOKENS model calls, its batch generates together
(TorchServe's batch of 8 and 5 ms, on one worker per core or one worker on both)."""


def served(archive_path: Path, built: Built, seconds: float) -> dict[str, Any]:
    """The archive's best figure behind a real server over `SHAPES` and `CONNECTIONS`, keep-alive
    connections of one item each, counted in a steady window (`loadgen.steady_load`); every
    run's figure in `runs`."""
    runs = [
        served_as(archive_path, built, seconds, *shape, connections)
        for shape in (GENERATOR_SHAPES if generates(built) else SHAPES)
        for connections in torchserve.CONNECTIONS
    ]
    best = max(runs, key=lambda run: run["items_s"])
    return {**best, "runs": runs}


def served_as(
    archive_path: Path,
    built: Built,
    seconds: float,
    workers: int,
    threads: int,
    max_batch: int,
    delay_ms: int,
    connections: int,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        store.mkdir()
        (store / archive_path.name).symlink_to(archive_path)
        body, headers = request_body(built, Path(tmp))
        name = archive_path.stem
        server = scriptserve("scriptserve", store, name, workers, threads, max_batch, delay_ms)
        with server:
            url = f"{server.url}/predictions/{name}"
            load = steady_load(
                url, connections, STEADY_WARMUP_S, seconds, body.read_bytes(), headers
            )
    if load.errors:
        raise RuntimeError(f"{name}: {load.errors} errors under load")
    return {
        "workers": workers,
        "threads": threads,
        "batch": max_batch,
        "delay_ms": delay_ms,
        "connections": connections,
        "items_s": load.rps * generated_tokens(built),
        "p50_ms": load.p50_ms,
        "p99_ms": load.p99_ms,
    }


def torchserve_served(
    built: Built, inputs: Mapping[str, np.ndarray], seconds: float
) -> dict[str, Any] | None:
    """TorchServe 0.12's best served figure on the model's TorchScript file, or None (with
    the reason on stderr) where it cannot run."""
    problem = torchserve.available()
    if problem is not None:
        print(f"TorchServe left out: {problem}", file=sys.stderr)
        return None
    extra = [p for p in built.extra_files if p.name == "tokenizer.json"]
    handler = "generate" if generates(built) else built.model.kind
    with tempfile.TemporaryDirectory() as tmp:
        body, headers = request_body(built, Path(tmp))
        best = torchserve.best_rate(
            built.model.name,
            torchscript_file(built, inputs),
            handler,
            extra,
            list(inputs),
            body,
            headers,
            seconds,
        )
    tokens = generated_tokens(built)
    for run in [best, *best["runs"]]:
        run["items_s"] *= tokens
    return best


def measure(
    name: str, size: str, batch: int, seconds: float, peak: dict[str, float]
) -> dict[str, Any]:
    built = files(name, size)
    store = WORK / size / "store"
    inputs = batch_inputs(built, batch)
    fp32 = archive(built, name, store)
    # The model's int8 modes in order (dynamic first where it has both): the first the accuracy
    # guard accepts is measured; the refusals before it are reported.
    refused: dict[str, str] = {}
    int8: Path | str = "no int8 mode"
    for mode in built.model.quantize:
        label = f"{name}-int8" if mode == built.model.quantize[0] else f"{name}-{mode}"
        int8 = archive(built, label, store, "--quantize", mode)
        if isinstance(int8, Path):
            break
        refused[mode] = int8
    # bfloat16 (`--precision bf16`): refused, with the reason, where the CPU has neither
    # AVX512-BF16 nor AMX; held to the same accuracy guard as int8.
    bf16 = archive(built, f"{name}-bf16", store, "--precision", "bf16")
    if isinstance(fp32, str):
        raise RuntimeError(fp32)
    rows: dict[str, Any] = {".pt2 fp32": backend_rate(fp32, "pt2", inputs, seconds)}
    if isinstance(int8, Path):
        rows[f".pt2 {mode}"] = backend_rate(int8, "pt2", inputs, seconds)
    if isinstance(bf16, Path):
        rows[".pt2 bf16"] = backend_rate(bf16, "pt2", inputs, seconds)
    rows["TorchScript"] = backend_rate(
        torchscript_file(built, inputs), "torchscript", inputs, seconds
    )
    rows["ONNX Runtime"] = backend_rate(onnx_file(built, inputs), "onnx", inputs, seconds)
    rows.update(openvino_rates(built, inputs, seconds))
    flops = flops_per_item(built, inputs)
    validation: Any = int8  # the refusal, when the guard refused it
    if isinstance(int8, Path):
        with open_archive(int8) as reader:
            quantization = reader.manifest.scriptserve.quantization  # type: ignore[union-attr]
            validation = quantization.details.get("validation")
    bf16_validation: Any = bf16  # the refusal, when the CPU or the guard refused it
    if isinstance(bf16, Path):
        with open_archive(bf16) as reader:
            pt2 = reader.manifest.scriptserve.pt2  # type: ignore[union-attr]
            bf16_validation = pt2.precision_check if pt2 is not None else None
    served_rows = {".pt2 fp32": served(fp32, built, seconds)}
    if isinstance(int8, Path):
        served_rows[f".pt2 {mode}"] = served(int8, built, seconds)
    if isinstance(bf16, Path):
        served_rows[".pt2 bf16"] = served(bf16, built, seconds)
    return {
        "model": name,
        "batch": batch,
        "gflop_per_item": flops / 1e9,
        "in_process_items_s": rows,
        "fp32_peak_share": {k: v * flops / 1e9 / peak["fp32_gflops"] for k, v in rows.items()},
        "int8_peak_share": {k: v * flops / 1e9 / peak["int8_gops"] for k, v in rows.items()},
        "int8_mode": mode if isinstance(int8, Path) else None,
        "int8_validation": validation,
        "int8_refused": refused,
        "bf16_check": bf16_validation,
        "served": served_rows,
        "torchserve": torchserve_served(built, inputs, seconds),
    }


def report(results: list[dict[str, Any]], peak: dict[str, float]) -> None:
    print(f"peak: fp32 {peak['fp32_gflops']:.0f} GFLOP/s, int8 {peak['int8_gops']:.0f} GOP/s")
    for r in results:
        for mode, reason in r.get("int8_refused", {}).items():
            print(f"{r['model']} {mode}: {reason}")
        if isinstance(r.get("bf16_check"), str):
            print(f"{r['model']} bf16: {r['bf16_check']}")
        print(f"\n{r['model']} (batch {r['batch']}, {r['gflop_per_item']:.2f} GFLOP per item)")
        for label, rate in r["in_process_items_s"].items():
            share = r["fp32_peak_share"][label]
            int8 = r["int8_peak_share"][label]
            print(
                f"  in-process {label:<18}{rate:>9.1f} items/s  {share:>6.1%} of fp32 peak, "
                f"{int8:>6.1%} of int8 peak"
            )
        rows = {
            f"{label} w{s['workers']}x{s['threads']} b{s['batch']} d{s['delay_ms']}"
            f" c{s['connections']}"
            if "workers" in s
            else label: s
            for label, s in r["served"].items()
        }
        if r["torchserve"] is not None:
            ts = r["torchserve"]
            rows[f"TorchServe w{ts['workers']} b{ts['batch']} c{ts['connections']}"] = ts
        for label, s in rows.items():
            print(
                f"  served     {label:<18}{s['items_s']:>9.1f} items/s  "
                f"p50 {s['p50_ms']:.1f} ms  p99 {s['p99_ms']:.1f} ms"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(ZOO))
    parser.add_argument("--size", choices=["full", "small"], default="full")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(WORK / "inductor-cache"))
    print(cpu_line(), file=sys.stderr)
    peak = gemm_peak(min(args.seconds, 5.0))
    results = []
    for name in args.models.split(","):
        try:
            results.append(measure(name, args.size, args.batch, args.seconds, peak))
        except Exception as exc:  # one model's failure is reported; the others are measured
            print(f"{name}: not measured: {exc!r}", file=sys.stderr)
            continue
        report(results[-1:], peak)
    write_results(
        "zoo",
        {
            "cpu": cpu_line(),
            "size": args.size,
            "peak": peak,
            "torch": torch.__version__,
            "results": results,
        },
    )
    print(json.dumps({"cpu": cpu_line()}))


if __name__ == "__main__":
    main()
