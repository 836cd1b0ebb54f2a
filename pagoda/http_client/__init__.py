"""Talking to a server from outside it: reading its event streams, starting one and waiting
until it answers. Used by bench, ops, the tests and benchmarks/; imports nothing of pagoda."""
