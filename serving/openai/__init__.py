"""The OpenAI-compatible HTTP API every kvmesh server speaks: request bodies and field rules
(protocol), bodies to kvmesh.v1 requests (requests), kvmesh.v1 responses to OpenAI bodies and
SSE (responses), the FastAPI app (app), and the byte-for-byte relay leg (relay)."""
