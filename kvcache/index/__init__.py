"""kvmesh.kvcache.index: the shared prefix index, one file per backend: ``api`` (what every
index answers: ``PrefixIndex``), ``redis`` with ``redis.lua`` (Redis/Valkey, the deployed one:
every call one round trip to server-side functions), ``memory`` (in process: the simulator and
tests), ``acl`` (the Redis users each role gets) and ``untrusted`` (what it does with records
it did not write). Imported on its own (``kvmesh.kvcache`` does not), and it imports nothing of
kvmesh outside ``kvcache``.
"""
