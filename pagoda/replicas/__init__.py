"""Data-parallel replicas behind one front: the replica set, its router policies, the prefix
tree cache-aware routing reads, request-shape pools, and Ray placement of replicas.

Sits above the engine (each replica is an AsyncLLM) and below the server and bench (the route
simulator drives the same policies). Ray is imported only by ray_actors.py, and only when
`--distributed-executor-backend ray` asks for it.
"""
