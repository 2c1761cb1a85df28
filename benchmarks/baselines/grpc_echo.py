"""The most a Python gRPC front end can serve: OIP's ModelInfer answered with a constant.

    python -m benchmarks.baselines.grpc_echo --port 9001 --mode aio     # grpc.aio, one loop
    python -m benchmarks.baselines.grpc_echo --port 9001 --mode sync    # grpc's thread pool

Each call's request bytes are taken as they arrive (no protobuf parsing) and answered with one
pre-serialized ModelInferResponse of ten floats, so what is measured is gRPC's own cost per
unary call in Python: any front end built on it, in the serving process or in a process of its
own feeding the workers, pays at least this. ServerLive answers too, for readiness.
"""

from __future__ import annotations

import argparse
import asyncio
import struct
from concurrent import futures

import grpc

from scriptserve.server.grpc._generated import open_inference_grpc_pb2 as oip

SERVICE = "inference.GRPCInferenceService"


def _answer() -> bytes:
    response = oip.ModelInferResponse(model_name="mlp", model_version="1.0")
    response.outputs.add(name="y", datatype="FP32", shape=[1, 10])
    response.raw_output_contents.append(struct.pack("<10f", *([0.0] * 10)))
    return response.SerializeToString()


ANSWER = _answer()
LIVE = oip.ServerLiveResponse(live=True).SerializeToString()


def _identity(data: bytes) -> bytes:
    return data


def _handlers(infer: object, live: object) -> grpc.GenericRpcHandler:
    def method(behaviour: object) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            behaviour,  # type: ignore[arg-type]
            request_deserializer=_identity,
            response_serializer=_identity,
        )

    return grpc.method_handlers_generic_handler(
        SERVICE, {"ModelInfer": method(infer), "ServerLive": method(live)}
    )


async def serve_aio(port: int) -> None:
    async def infer(request: bytes, context: object) -> bytes:
        return ANSWER

    async def live(request: bytes, context: object) -> bytes:
        return LIVE

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handlers(infer, live),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def serve_sync(port: int, threads: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads))
    server.add_generic_rpc_handlers(
        (_handlers(lambda request, context: ANSWER, lambda request, context: LIVE),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.baselines.grpc_echo")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", choices=("aio", "sync"), default="aio")
    p.add_argument("--threads", type=int, default=4, help="sync mode's thread pool")
    args = p.parse_args()
    if args.mode == "aio":
        try:
            import uvloop
        except ImportError:
            asyncio.run(serve_aio(args.port))
        else:
            uvloop.run(serve_aio(args.port))
    else:
        serve_sync(args.port, args.threads)


if __name__ == "__main__":
    main()
