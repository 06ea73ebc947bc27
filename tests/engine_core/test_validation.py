"""The one token-id range check, and ParamError naming its field."""

from __future__ import annotations

import pytest

from pagoda.engine_core.validation import TOKEN_ID_LIMIT, ParamError, check_token_ids, param_of


@pytest.mark.parametrize("ids", [[0, 5, 9], [], (3,), {7: 1.0}])
def test_ids_in_range_pass(ids):
    check_token_ids(ids, 10, "tokens")


@pytest.mark.parametrize("ids", [[10], [-1], [1, 2, 99], [True], [1.0], ["3"], [None], [TOKEN_ID_LIMIT]])
def test_anything_else_is_a_param_error_naming_the_field(ids):
    with pytest.raises(ParamError) as error:
        check_token_ids(ids, None if ids == [TOKEN_ID_LIMIT] else 10, "stop_token_ids")
    assert error.value.param == param_of(error.value) == "stop_token_ids"
    assert "stop_token_ids" in str(error.value)


def test_without_a_vocabulary_the_wire_limit_applies():
    check_token_ids([TOKEN_ID_LIMIT - 1], None, "prompt")
    assert param_of(ValueError("plain")) is None
