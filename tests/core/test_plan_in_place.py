"""Which resizes are done in place, and how (``core/schedule/inplace.py``
:func:`plan_in_place`, what the daemon does and the simulator models): the first running ranks
on each node kept stay on their devices, renumbered in their order; joiners get devices no
running replica holds."""

from __future__ import annotations

from pollux_local.core.schedule.inplace import plan_in_place

A0, A1, A2, A3 = ("a", "cpu:0"), ("a", "cpu:1"), ("a", "cpu:2"), ("a", "cpu:3")
B0, B1 = ("b", "cpu:0"), ("b", "cpu:1")


def test_a_grow_on_one_node_keeps_every_rank_and_adds_the_new_devices() -> None:
    assert plan_in_place([A0, A1], {"a": ["cpu:0", "cpu:1", "cpu:2"]}, ()) == ([A0, A1, A2], [0, 1])
    # the policy chose other devices: the running ranks keep theirs, joiners take new ones
    assert plan_in_place([A0, A1], {"a": ["cpu:1", "cpu:2", "cpu:3"]}, ()) == ([A0, A1, A2], [0, 1])


def test_a_shrink_keeps_the_lowest_ranks_devices_unless_another_start_claims_one() -> None:
    assert plan_in_place([A0, A1, A2], {"a": ["cpu:2"]}, ()) == ([A0], [0])
    assert plan_in_place([A0, A1, A2], {"a": ["cpu:2"]}, {A0}) is None


def test_a_group_grows_onto_another_node_and_shrinks_off_it() -> None:
    assert plan_in_place([A0], {"a": ["cpu:0"], "b": ["cpu:0", "cpu:1"]}, ()) == (
        [A0, B0, B1],
        [0],
    )
    assert plan_in_place([A0, B0, B1], {"a": ["cpu:0"]}, ()) == ([A0], [0])


def test_a_move_keeps_rank_0s_node_and_replaces_the_ranks_on_the_node_given_up() -> None:
    # ranks 2 and 3 on b leave; joiners on a's free devices take ranks 2 and 3
    assert plan_in_place([A0, A1, B0, B1], {"a": ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]}, ()) == (
        [A0, A1, A2, A3],
        [0, 1],
    )


def test_rank_0s_node_given_up_hands_rank_0_to_the_lowest_rank_that_stays() -> None:
    # rank 0 on a leaves; rank 1 on b becomes rank 0 and a joiner on b takes rank 1
    assert plan_in_place([A0, B0], {"b": ["cpu:0", "cpu:1"]}, ()) == ([B0, B1], [1])
    # ranks that stay after one that leaves are renumbered: rank 2 becomes rank 1
    assert plan_in_place([A0, A1, B0], {"a": ["cpu:0"], "b": ["cpu:0", "cpu:1"]}, ()) == (
        [A0, B0, B1],
        [0, 2],
    )


def test_what_cannot_be_done_in_place() -> None:
    # no node keeps a replica: nobody holds the state to hand over
    assert plan_in_place([A0, A1], {"b": ["cpu:0", "cpu:1"]}, ()) is None
    # the same devices: nothing to do in place
    assert plan_in_place([A0, A1], {"a": ["cpu:1", "cpu:0"]}, ()) is None
    # a device that stays is another start's
    assert plan_in_place([A0, B0], {"b": ["cpu:1"]}, {B0}) is None
