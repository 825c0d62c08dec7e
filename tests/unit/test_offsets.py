from streams.offsets import OffsetTracker


def test_out_of_order_finish_commits_only_the_contiguous_prefix():
    t = OffsetTracker()
    for o in range(5):
        t.start("p0", o)
    t.finish("p0", 2)
    t.finish("p0", 1)
    assert t.committable() == {"p0": 0}
    t.finish("p0", 0)
    assert t.committable() == {"p0": 3}
    t.mark_committed({"p0": 3})
    assert t.committable() == {}
    t.finish("p0", 4)
    assert t.committable() == {}  # 3 still in flight
    t.finish("p0", 3)
    assert t.committable() == {"p0": 5}


def test_partitions_are_independent_and_revoke_forgets():
    t = OffsetTracker()
    t.start("a", 10)
    t.start("b", 7)
    t.finish("b", 7)
    assert t.committable() == {"a": 10, "b": 8}
    t.mark_committed({"a": 10, "b": 8})
    t.revoke(["a"])
    t.finish("a", 10)  # late ack after revoke: ignored
    assert t.committable() == {}
    assert t.in_flight() == 0
