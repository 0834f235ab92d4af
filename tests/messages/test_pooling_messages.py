"""PoolingParams as vLLM's (keywords, validation naming the field, the older activation
name) and the pooled data's wire form."""

from __future__ import annotations

import array

import msgspec
import pytest

from messages.errors import InvalidRequestError
from messages.pooling import PooledData, PoolingParams


def test_pooling_params_round_trip_on_the_wire():
    params = PoolingParams(dimensions=16, normalize=False, truncate_prompt_tokens=-1).with_task("embed")
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=PoolingParams)
    assert decoded == params and decoded.task == "embed"


def test_activation_is_the_older_name_of_use_activation():
    assert PoolingParams(activation=False).use_activation is False
    with pytest.raises(InvalidRequestError) as error:
        PoolingParams(activation=False, use_activation=True)
    assert error.value.param == "use_activation"


@pytest.mark.parametrize("fields,param", [
    ({"dimensions": 0}, "dimensions"), ({"dimensions": True}, "dimensions"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"task": "generate"}, "task"),
])
def test_bad_values_name_their_field(fields, param):
    with pytest.raises(InvalidRequestError) as error:
        PoolingParams(**fields)
    assert error.value.param == param


def test_a_task_already_set_is_not_changed_silently():
    with pytest.raises(InvalidRequestError):
        PoolingParams(task="classify").with_task("embed")


def test_pooled_data_decodes_vectors_and_per_token_rows():
    values = array.array("f", [0.5, -1.0, 2.0, 4.0, 8.0, 16.0]).tobytes()
    assert PooledData(values, [6]).tolist() == [0.5, -1.0, 2.0, 4.0, 8.0, 16.0]
    assert PooledData(values, [3, 2]).tolist() == [[0.5, -1.0], [2.0, 4.0], [8.0, 16.0]]
