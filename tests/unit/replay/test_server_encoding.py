"""Proto encoding of the servicer, without a network: the Sample fast path against its reference,
request validation, and Stats."""

from __future__ import annotations

import pytest

from groups import make_group
from services.common.errors import InvalidArgument
from services.common.pb.flywheel.v1 import replay_pb2
from services.replay.server import check_sample_request, encode_sample_response, sample_response, stats_response
from services.replay.store import SampleResult, StoreStats


@pytest.mark.parametrize("result", [
    SampleResult(ready=False, missing=3, stale_ids=["a", "b"]),
    SampleResult(ready=True, group_ids=["x"], payloads=[make_group("x", 1).SerializeToString()]),
    SampleResult(ready=True, group_ids=[f"g{i}" for i in range(4)], stale_ids=["s"], payloads=[
        make_group(f"g{i}", i, completions=16, tokens=300 * i).SerializeToString() for i in range(4)]),
])
def test_spliced_sample_response_parses_to_the_reference(result):
    fast = replay_pb2.SampleResponse.FromString(encode_sample_response(result))
    assert fast == sample_response(result)


@pytest.mark.parametrize("fields", [dict(step=-1, prompts_per_step=1), dict(step=0, prompts_per_step=0),
                                    dict(step=0, prompts_per_step=1, max_staleness=-1)])
def test_bad_sample_request_is_invalid_argument(fields):
    with pytest.raises(InvalidArgument):
        check_sample_request(replay_pb2.SampleRequest(**fields))


def test_stats_response_reports_age_of_oldest_group():
    stats = StoreStats(size=2, size_by_version={0: 1, 3: 1}, stale_dropped=4, oldest_finished_at_s=100.0,
                       dead_lettered=1, duplicates=2)
    response = stats_response(stats, 64, now_s=130.5)
    assert response.oldest_age_seconds == 30.5 and dict(response.size_by_version) == {0: 1, 3: 1}
    assert (response.capacity, response.stale_dropped, response.duplicates) == (64, 4, 2)
    empty = StoreStats(size=0, size_by_version={}, stale_dropped=0, oldest_finished_at_s=None,
                       dead_lettered=0, duplicates=0)
    assert stats_response(empty, 64, now_s=130.5).oldest_age_seconds == 0.0
