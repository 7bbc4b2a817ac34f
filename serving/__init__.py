"""kvmesh.serving: what every kvmesh server speaks and is built from.

The gRPC server helper (health, reflection, interceptors), the OpenAI HTTP app over a
``Backend``, TLS and bearer-token auth, errors with their gRPC code and HTTP status, the
tokenizer and chat template, prompt -> token ids, sampling parameters from the proto,
background loops, ``ModelInfo``, metrics helpers and config options. The router and the
replica are both assembled from these parts; this package imports only ``kvmesh.kvcache``
and ``kvmesh.protos``.
"""
