"""The warm resize order's contract (``api/resize.py``): who stays, and what is refused."""

from __future__ import annotations

import pytest

from pollux_local.api.errors import PolluxError
from pollux_local.api.resize import ResizeOrder, decode_order, encode_order


def test_by_default_the_ranks_below_the_new_size_stay() -> None:
    order = ResizeOrder(generation=2, world_size=2, master_addr="10.0.0.1", master_port=29500)
    assert [order.stays(rank) for rank in range(4)] == [True, True, False, False]
    assert decode_order(encode_order(order)) == order


def test_a_move_keeps_only_the_lowest_ranks_it_names() -> None:
    order = ResizeOrder(3, 4, "10.0.0.1", 29500, kept=1, num_nodes=2)
    assert [order.stays(rank) for rank in range(4)] == [True, False, False, False]
    assert decode_order(encode_order(order)) == order


def test_named_ranks_stay_renumbered_and_rank_0_may_leave() -> None:
    order = ResizeOrder(4, 3, "10.0.0.2", 29500, ranks=(2, 3), num_nodes=2)
    assert [order.new_rank(rank) for rank in range(4)] == [None, None, 0, 1]
    assert not order.stays(0) and order.stays(3)
    assert decode_order(encode_order(order)) == order


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"generation":1,"world_size":2,"master_addr":"a","master_port":1,"kept":3}',
         "keeps 3 of 2 replicas"),
        (b'{"generation":1,"world_size":2,"master_addr":"a","master_port":1,"kept":0}',
         "bad resize order"),
        (b'{"generation":1,"world_size":2,"master_addr":"a","master_port":1,"num_nodes":0}',
         "bad resize order"),
        (b'{"generation":1,"world_size":2,"master_addr":"a","master_port":1,"ranks":[1,1]}',
         "a rank kept twice"),
        (b'{"generation":1,"world_size":2,"master_addr":"a","master_port":1,"ranks":[0,1,2]}',
         "keeps 3 of 2 replicas"),
        (b'{"generation":1,"world_size":2,"master_addr":"a","master_port":1,"ranks":[]}',
         "keeps 0 of 2 replicas"),
        (b'{"generation":1,"world_size":2,"master_addr":"a","master_port":1,"ranks":[-1]}',
         "bad resize order"),
        (b'{"generation":1,"world_size":3,"master_addr":"a","master_port":1,"ranks":[2],"kept":2}',
         "kept and ranks disagree"),
    ],
)  # fmt: skip
def test_an_order_keeping_more_than_it_has_or_none_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(PolluxError, match=message):
        decode_order(data)
