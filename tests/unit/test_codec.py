"""Codec and schemas: round trips, packed arrays, and every way a record can be poison."""

import msgpack
import numpy as np
import pytest

from engine.schemas import SCHEMAS, Completion, Experience, SchemaError, Task, TokenChunk
from streams.codec import DecodeError, decode, encode


def _completion(n: int = 5, **kw) -> Completion:
    base = dict(
        sample_id="s1", task_id="t1", domain="arith", group_index=0, group_size=4,
        prompt_ids=np.arange(3, dtype=np.int32), response_ids=np.arange(n, dtype=np.int32),
        logprobs=np.full(n, -0.5, dtype=np.float32), loss_mask=np.ones(n, dtype=np.uint8),
        weight_versions=np.zeros(n, dtype=np.int32), text="42", finish_reason="stop",
    )
    base.update(kw)
    return Completion(**base)


def test_round_trip_keeps_arrays_packed_and_equal():
    msg = _completion(1000)
    value, mid = encode(msg, producer="test")
    raw = msgpack.unpackb(value, raw=False)
    assert raw["schema"] == "completion" and raw["id"] == mid and raw["producer"] == "test"
    # packed: the body holds bytes of exactly n * itemsize, not lists
    assert isinstance(raw["body"]["response_ids"], bytes) and len(raw["body"]["response_ids"]) == 4000
    assert isinstance(raw["body"]["loss_mask"], bytes) and len(raw["body"]["loss_mask"]) == 1000
    env = decode(value)
    assert env.id == mid
    got = env.message
    assert isinstance(got, Completion)
    np.testing.assert_array_equal(got.response_ids, msg.response_ids)
    np.testing.assert_array_equal(got.logprobs, msg.logprobs)
    assert got.response_ids.dtype == np.dtype("<i4")


def test_every_schema_is_registered_with_a_version():
    assert {"task", "token_chunk", "completion", "outcome", "experience", "dead_letter",
            "sandbox_request", "sandbox_result", "weight_manifest", "heartbeat"} <= set(SCHEMAS)
    assert all(isinstance(c.VERSION, int) and c.VERSION >= 1 for c in SCHEMAS.values())


@pytest.mark.parametrize("data,reason", [
    (b"\xc1\xff\x00garbage", "undecodable"),
    (msgpack.packb([1, 2, 3]), "not_an_envelope"),
    (msgpack.packb({"schema": "nope", "version": 1, "id": "x", "body": {}}), "unknown_schema"),
    (msgpack.packb({"schema": "task", "version": 99, "id": "x", "body": {}}), "unsupported_version"),
    (msgpack.packb({"schema": "task", "version": 1, "id": "x", "body": {"task_id": "t"}}), "invalid"),
    (msgpack.packb({"schema": "task", "version": 1, "id": "x",
                    "body": {"task_id": "t", "domain": "d", "prompt": 5, "spec": {}}}), "invalid"),
    (b"\xa3\xff\xfe\xfd", "undecodable"),  # str8 with invalid UTF-8
])
def test_poison_records_raise_decode_error_with_reason(data, reason):
    with pytest.raises(DecodeError) as ei:
        decode(data)
    assert ei.value.reason == reason


def test_oversized_record_is_rejected_before_parsing():
    value, _ = encode(_completion(10), producer="t")
    with pytest.raises(DecodeError) as ei:
        decode(value, max_bytes=len(value) - 1)
    assert ei.value.reason == "oversized"


def test_invalid_utf8_in_a_text_field_is_invalid_not_a_crash():
    value, _ = encode(_completion(2), producer="t")
    raw = msgpack.unpackb(value, raw=False)
    raw["body"]["text"] = b"\xff\xfe"  # bytes where a string belongs
    with pytest.raises(DecodeError) as ei:
        decode(msgpack.packb(raw, use_bin_type=True))
    assert ei.value.reason == "invalid" and "text" in str(ei.value)


def test_array_lengths_must_agree():
    with pytest.raises(SchemaError, match="per-token arrays differ"):
        _completion(4, logprobs=np.zeros(3, dtype=np.float32)).validate()


def test_array_with_partial_item_is_invalid():
    value, _ = encode(_completion(2), producer="t")
    raw = msgpack.unpackb(value, raw=False)
    raw["body"]["response_ids"] = b"\x00\x01\x02"  # 3 bytes is not a whole int32
    with pytest.raises(DecodeError, match="response_ids"):
        decode(msgpack.packb(raw, use_bin_type=True))


def test_task_limits_are_checked():
    with pytest.raises(SchemaError, match="group_size"):
        Task(task_id="t", domain="d", prompt="p", spec={}, group_size=100000).validate()
    with pytest.raises(SchemaError, match="max_new_tokens"):
        Task(task_id="t", domain="d", prompt="p", spec={}, sampling={"max_new_tokens": 10**9}).validate()
    with pytest.raises(SchemaError, match="unknown field"):
        Task.from_body({"task_id": "t", "domain": "d", "prompt": "p", "spec": {}, "evil": 1})


def test_expect_rejects_a_valid_message_on_the_wrong_topic():
    chunk = TokenChunk(sample_id="s", task_id="t", seq=0, token_ids=np.zeros(1, np.int32),
                       logprobs=np.zeros(1, np.float32), weight_version=0)
    value, _ = encode(chunk, producer="t")
    assert decode(value, expect=("token_chunk",)).message.sample_id == "s"
    with pytest.raises(DecodeError) as ei:
        decode(value, expect=("task",))
    assert ei.value.reason == "unknown_schema"


def test_experience_min_version_ignores_observation_tokens():
    exp = Experience(sample_id="s", task_id="t", domain="d", prompt_ids=np.zeros(1, np.int32),
                     response_ids=np.zeros(4, np.int32), logprobs=np.zeros(4, np.float32),
                     loss_mask=np.array([1, 0, 0, 1], np.uint8),
                     weight_versions=np.array([3, -1, -1, 4], np.int32),
                     reward=1.0, advantage=0.5, group_size=4)
    assert exp.min_version() == 3
