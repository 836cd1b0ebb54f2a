"""The state snapshots of hybrid models' prefix caching (pagoda.core.state_snapshots): a reserved
slot is found under its block's hash once the block is computed, least recently used snapshots
make room first, and a request's unregistered reservations go back when it ends."""

from __future__ import annotations

from pagoda.core.state_snapshots import StateSnapshots


def test_a_snapshot_is_found_once_its_block_is_computed() -> None:
    snapshots = StateSnapshots(first_slot=4, count=2)
    slot = snapshots.reserve("a", 1)
    assert slot in (4, 5)
    snapshots.register("a", [b"h0", b"h1"], num_computed_blocks=1)  # block 1 not computed yet
    assert snapshots.lookup(b"h1") is None
    snapshots.register("a", [b"h0", b"h1"], num_computed_blocks=2)
    assert snapshots.lookup(b"h1") == slot and snapshots.num_cached == 1


def test_the_least_recently_used_snapshot_makes_room() -> None:
    snapshots = StateSnapshots(first_slot=0, count=2)
    for name, block_hash in (("a", b"ha"), ("b", b"hb")):
        snapshots.reserve(name, 0)
        snapshots.register(name, [block_hash], 1)
    assert snapshots.lookup(b"ha") is not None  # b is now the least recently used
    slot = snapshots.reserve("c", 0)
    assert snapshots.lookup(b"hb") is None and slot is not None
    assert snapshots.reserve("d", 0) is not None and snapshots.num_cached == 0  # then a's
    assert snapshots.reserve("e", 0) is None  # every slot reserved by requests computing


def test_a_request_gives_back_its_reservations_and_the_weights_clear_all() -> None:
    snapshots = StateSnapshots(first_slot=0, count=1)
    snapshots.reserve("a", 3)
    snapshots.drop("a")
    snapshots.reserve("b", 0)
    snapshots.register("b", [b"h"], 1)
    snapshots.clear()
    assert snapshots.lookup(b"h") is None and snapshots.reserve("c", 0) == 0
