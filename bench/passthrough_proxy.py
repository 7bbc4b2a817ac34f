"""The floor under ``kvmesh bench router``'s added latency: a gRPC proxy that forwards every
Generate to one replica and does nothing else (no tokenizing, no index, no policy, no
accounting), in the same language and gRPC stack as the router. What the router adds
beyond this is what its decision and bookkeeping cost.

    python -m kvmesh.bench.passthrough_proxy REPLICA_ADDRESS PORT
"""

from __future__ import annotations

import asyncio
import sys

import grpc

from kvmesh.protos import pb_grpc


class PassThrough(pb_grpc.RouterServicer):
    def __init__(self, replica_address: str):
        self.replica_address = replica_address
        self.stub: pb_grpc.ReplicaStub | None = None  # made on the serving loop

    async def Generate(self, request, context):
        if self.stub is None:
            self.stub = pb_grpc.ReplicaStub(grpc.aio.insecure_channel(self.replica_address))
        async for response in self.stub.Generate(request, timeout=context.time_remaining()):
            yield response


async def serve(replica_address: str, port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_RouterServicer_to_server(PassThrough(replica_address), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], int(sys.argv[2])))
