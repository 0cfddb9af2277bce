from hypothesis import given
from hypothesis import strategies as st
import pytest

from diloco.clock import Order, VectorClock
from diloco.errors import InvalidArgument

processes = st.sampled_from(["C", "S0", "S1", "L1", "L2"])
clocks = st.dictionaries(processes, st.integers(0, 5)).map(VectorClock)


@given(clocks, clocks)
def test_merge_commutative(a, b):
    assert a.merge(b) == b.merge(a)


@given(clocks, clocks, clocks)
def test_merge_associative(a, b, c):
    assert a.merge(b).merge(c) == a.merge(b.merge(c))


@given(clocks)
def test_merge_idempotent(a):
    assert a.merge(a) == a


@given(clocks)
def test_happened_before_irreflexive(a):
    assert not a.happened_before(a)
    assert a.compare(a) is Order.EQUAL


@given(clocks, clocks)
def test_happened_before_asymmetric(a, b):
    assert not (a.happened_before(b) and b.happened_before(a))


@given(clocks, clocks, clocks)
def test_happened_before_transitive(a, b, c):
    if a.happened_before(b) and b.happened_before(c):
        assert a.happened_before(c)


@given(clocks, processes)
def test_tick_moves_strictly_forward(a, p):
    assert a.happened_before(a.tick(p))
    assert a.tick(p)[p] == a[p] + 1


@given(clocks, clocks)
def test_merge_is_upper_bound(a, b):
    m = a.merge(b)
    assert a.compare(m) in (Order.BEFORE, Order.EQUAL)
    assert b.compare(m) in (Order.BEFORE, Order.EQUAL)


def test_message_exchange_orders_send_before_receive():
    learner = VectorClock().tick("L1")  # send
    shard = VectorClock({"S0": 3}).receive("S0", learner)
    assert learner.happened_before(shard)
    other = VectorClock().tick("L2")
    assert other.compare(shard) is Order.CONCURRENT


def test_zero_entries_are_absent():
    assert VectorClock({"a": 0}) == VectorClock()
    assert hash(VectorClock({"a": 0, "b": 1})) == hash(VectorClock({"b": 1}))


@pytest.mark.parametrize("entries", [{"a": -1}, {"": 1}, {"a": 1.5}])
def test_invalid_entries_rejected(entries):
    with pytest.raises(InvalidArgument):
        VectorClock(entries)


def test_a_clock_prints_sorted_and_bad_entries_are_named():
    assert str(VectorClock({"S0": 3, "L1": 2})) == "{L1:2, S0:3}"
    assert str(VectorClock()) == "{}"
    with pytest.raises(InvalidArgument, match=r"^vector clock process names must be non-empty strings, got ''$"):
        VectorClock({"": 1})
    with pytest.raises(InvalidArgument, match=r"^vector clock entry 'L0' must be a non-negative int, got -1$"):
        VectorClock({"L0": -1})


@given(clocks, clocks, st.sets(processes))
def test_a_restricted_receive_names_only_known_processes_and_the_receiver(a, b, known):
    got = a.receive("C", b, known)
    assert set(got.entries) <= known | {"C"}
    assert got["C"] == max(a["C"], b["C"]) + 1
    assert all(got[k] == max(a[k], b[k]) for k in known - {"C"})


def test_names_a_sender_made_up_cannot_grow_the_receivers_clock():
    mine = VectorClock({"C": 3, "L0": 2, "L1": 7})
    hostile = VectorClock({"L1": 9, **{f"L{10**8 + i}": 1 for i in range(4095)}})
    got = mine.receive("C", hostile, {"L0", "S0"})  # L1 is gone: its entry goes too
    assert got == VectorClock({"C": 4, "L0": 2})
    assert mine.receive("C", hostile) == mine.merge(hostile).tick("C")  # unrestricted: as before
