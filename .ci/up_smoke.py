"""`kvmesh up` from a plain install serves one gRPC request, then stops on SIGINT (CI smoke)."""

import re
import signal
import subprocess
import sys
import time

import grpc

from kvmesh.protos import pb, pb_grpc

kvmesh, model = sys.argv[1], sys.argv[2]
argv = [
    kvmesh,
    "up",
    "--model",
    model,
    "--replicas",
    "1",
    "--port",
    "0",
    "--http-port",
    "0",
    "--num-kv-blocks",
    "64",
]
proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
try:
    text, deadline = "", time.monotonic() + 300
    while "Ctrl-C" not in text and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            sys.exit(f"kvmesh up exited early:\n{text}{proc.stderr.read()}")
        text += line
    address = re.search(r"router gRPC\s+(\S+)", text).group(1)
    with grpc.insecure_channel(address) as channel:
        request = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(temperature=0, max_tokens=4))
        responses = list(pb_grpc.RouterStub(channel).Generate(request, timeout=120))
    assert responses[-1].complete.usage.completion_tokens == 4, responses[-1]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0
finally:
    if proc.poll() is None:
        proc.kill()
