"""OutputRouter: each request's outputs go to the API server that sent it, and the
router forgets a request at its final output."""

import pytest

from gyrfalcon.ipc.messages import RequestOutput
from gyrfalcon.scheduler.routing import OutputRouter


def out(rid: str, reason: str | None = None) -> RequestOutput:
    return RequestOutput(rid, [1], finish_reason=reason)


def rids(outputs: list[RequestOutput]) -> list[str]:
    return [o.rid for o in outputs]


def test_outputs_go_to_their_sender_in_order_and_final_outputs_end_the_entry():
    r = OutputRouter(3)
    r.add("0:a", 0)
    r.add("2:b", 2)
    r.add("0:c", 0)
    per = r.split([out("0:a"), out("2:b"), out("0:c", "stop"), out("0:a")])
    assert [rids(p) for p in per] == [["0:a", "0:c", "0:a"], [], ["2:b"]]
    assert r.num_tracked == 2 and r.check({"0:a", "2:b"}) is None
    per = r.split([out("2:b", "abort"), out("0:a", "length")])
    assert [rids(p) for p in per] == [["0:a"], [], ["2:b"]]
    assert r.num_tracked == 0 and r.check(set()) is None


def test_a_duplicate_rid_keeps_the_first_request_routed():
    r = OutputRouter(2)
    r.add("1:a", 1)
    r.add("1:a", 1)  # the scheduler answers the duplicate with an error output
    assert rids(r.split([out("1:a", "error")])[1]) == ["1:a"]
    assert r.num_tracked == 1
    assert rids(r.split([out("1:a"), out("1:a", "stop")])[1]) == ["1:a", "1:a"]
    assert r.num_tracked == 0


def test_check_names_leaked_and_missing_routes():
    r = OutputRouter(2)
    r.add("0:a", 0)
    r.add("1:b", 1)
    assert r.check({"0:a", "1:b"}) is None
    err = r.check({"1:b", "1:z"})
    assert err is not None and "0:a" in err and "1:z" in err


def test_an_output_nobody_sent_and_an_unknown_server_are_bugs():
    r = OutputRouter(2)
    with pytest.raises(AssertionError):
        r.split([out("0:x")])
    with pytest.raises(AssertionError):
        r.add("2:x", 2)


def test_one_api_server_gets_everything_and_keeps_nothing():
    r = OutputRouter(1)
    r.add("a", 0)
    outputs = [out("a"), out("b", "stop")]
    assert r.split(outputs) == [outputs]
    assert r.num_tracked == 0 and r.check({"a", "zzz"}) is None
