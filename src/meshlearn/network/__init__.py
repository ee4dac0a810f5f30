"""The compute-sharing network: a bootstrap registry, providers that train, requesters that submit tasks.

Layers inside: ``envelope`` (signed, size-capped control messages) and ``rpc`` (request/reply
over ZeroMQ) carry everything; ``registry`` and ``bootstrap`` keep the pool of providers;
``datashare`` moves partitions; ``aggregation`` and ``taskrun`` train a task on a provider;
``provider`` and ``requester`` are the two user-facing roles.
"""
