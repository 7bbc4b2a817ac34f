"""kvmesh.cluster: launching and supervising a deployment: ``kvmesh up``'s settings and
launcher (Ray, Redis, replica actors per model, the router), the supervisor that keeps
replicas alive, the embedded Redis-protocol servers, the deployment's secrets, node drains.

It may import the serving parts (kvcache, protos, serving, router, replica); it must not
import ``cli`` or ``bench`` (``tests/test_layering.py``).
"""
