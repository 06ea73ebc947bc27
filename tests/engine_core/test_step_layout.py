"""A step's flat layout (engine_core/model_runner.py): decodes first, long prompts' chunks (bulk rows) last,
and what the other ranks receive of it (engine_core/parallel/step_message.py)."""

from __future__ import annotations

import numpy as np

from pagoda.engine_core.model_runner import BULK_PROMPT_TOKENS, LogitsRows, _layout
from pagoda.engine_core.parallel import step_message
from pagoda.engine_core.request import Request
from pagoda.engine_core.sampling_params import SamplingParams
from pagoda.engine_core.step_inputs import prepare_step

BLOCK = 16


def _request(name: str, prompt: int, computed: int, outputs: int = 0) -> Request:
    """A request with a `prompt`-token prompt and `outputs` sampled tokens, `computed` of them computed
    once this step runs (the scheduler has advanced it)."""
    request = Request(name, list(range(1, prompt + 1)), SamplingParams(max_tokens=100))
    for t in range(outputs):
        request.append_token(7 + t)
    request.num_computed_tokens = computed
    request.block_ids = [list(range(-(-(prompt + outputs) // BLOCK)))]
    return request


def test_decodes_first_long_prompts_last():
    long = BULK_PROMPT_TOKENS
    scheduled = [
        (_request("long-chunk", long + 50, 64), 64),  # the first 64 tokens of a long prompt
        (_request("decode", 20, 22, outputs=2), 1),
        (_request("short-prompt", 30, 30), 30),
        (_request("long-tail", long, long), 1),  # a long prompt's last token alone: it attends as a decode
        (_request("long-decode", long, long + 1, outputs=1), 1),  # past its prompt: a decode
        (_request("long-two", long, long), 2),  # a long prompt's last two tokens: bulk rows
        (_request("short-tail", 10, 10), 1),  # a short prompt's last token: computed as a decode
    ]
    requests, counts = [r for r, _ in scheduled], [n for _, n in scheduled]
    order, bulk = _layout(requests, counts)
    names = [requests[i].request_id for i in order]
    assert names == ["decode", "long-tail", "long-decode", "short-tail", "short-prompt", "long-chunk", "long-two"]
    assert bulk == 2
    step = prepare_step([requests[i] for i in order], [counts[i] for i in order], BLOCK, None, bulk)
    assert step.num_decodes == 4
    assert step.bulk_rows_from == 4 + 30
    assert np.diff(step.query_start_loc).tolist() == [30, 64, 2]
    assert len(step.token_ids) == 4 + 30 + 64 + 2
    # where bulk rows would compute as the others do (no AMX), nothing is laid out as bulk
    order, bulk = _layout(requests, counts, bulk_prompts=False)
    assert bulk == 0 and prepare_step([requests[i] for i in order], [counts[i] for i in order], BLOCK).num_decodes == 4


def test_other_ranks_receive_where_the_bulk_rows_start():
    requests = [_request("decode", 20, 22, outputs=2), _request("long", BULK_PROMPT_TOKENS, BULK_PROMPT_TOKENS)]
    step = prepare_step(requests, [1, BULK_PROMPT_TOKENS], BLOCK, None, 1)
    rows = LogitsRows(np.zeros((0, 2), dtype=np.int64), np.array([0, BULK_PROMPT_TOKENS], dtype=np.int64))
    message = step_message.decode(b"".join(bytes(part) for part in step_message.encode_step(step, rows)))
    assert not isinstance(message, int)
    assert message.step.bulk_rows_from == step.bulk_rows_from == 1
    assert message.step.num_decodes == 1 and message.step.token_ids.tolist() == step.token_ids.tolist()


def test_other_ranks_receive_the_steps_state_copies():
    """A recurrent model's snapshot copies (engine_core/state_snapshots.py) travel with the step: every rank
    copies the same rows of its own state pools."""
    requests = [_request("decode", 20, 22, outputs=2), _request("long", 40, 40)]
    step = prepare_step(requests, [1, 40], BLOCK)
    step.state_loads = np.array([[9, 2]], dtype=np.int64)
    step.state_saves = np.array([[1, 7], [2, 8]], dtype=np.int64)
    rows = LogitsRows(np.zeros((0, 2), dtype=np.int64), np.array([0, 40], dtype=np.int64))
    message = step_message.decode(b"".join(bytes(part) for part in step_message.encode_step(step, rows)))
    assert not isinstance(message, int)
    assert message.step.state_loads.tolist() == [[9, 2]]
    assert message.step.state_saves.tolist() == [[1, 7], [2, 8]]
    empty = step_message.decode(
        b"".join(bytes(part) for part in step_message.encode_step(prepare_step(requests, [1, 40], BLOCK), rows))
    )
    assert not isinstance(empty, int) and empty.step.state_loads.shape == (0, 2)
