"""What every in-test OpenAI backend has (a one-model ``OpenAIBackend`` over token ids, 8
slots); each test's subclass says how it streams (``generate``)."""

from kvmesh.serving.admission import InflightLimit
from kvmesh.serving.limits import InputLimits
from kvmesh.serving.model_info import ModelInfo


class FakeBackend:
    model = ModelInfo("m", 16, 64, 100, 1)
    tokenizer = None
    inputs = InputLimits()
    relays_sse = False

    def __init__(self) -> None:
        self.inflight = InflightLimit(8, "test backend")

    def admit(self, count=1, policy=""):
        return self.inflight.take(count)

    async def prompt_ids(self, request):
        return list(request.token_ids.ids)

    def render_metrics(self) -> bytes:
        return b""
