"""How rows of token ids and log-probs become the learner's padded tensors.

Aspects under test:
- ``build_sequence_batch`` lays prompts left-padded and responses right-padded, with the
  attention, position and response masks, the same for lists (an engine's output) and numpy
  arrays (a ``Trajectory`` from the experience stream);
- ``pad_rows`` right-pads float rows (float32 and float64 arrays or lists) and cuts long ones;
- a trainer's ``Experience`` built from decoded binary trajectories gives the tensors the same
  rows as lists give.
"""

from __future__ import annotations

import numpy as np
import torch

from rljob_workers.buffer import Trajectory
from rljob_workers.policy import build_sequence_batch, pad_rows
from rljob_workers.trainer_worker import experience_of
from rljob_workers.transport.codec import decode_binary, encode_binary

PAD = 0


def test_build_sequence_batch_lists_left_pad_prompts_right_pad_responses() -> None:
    batch = build_sequence_batch([[1, 5, 6], [1, 7]], [[8, 9, 2], [10]], pad_id=PAD)

    assert batch.prompt_width == 3
    assert batch.input_ids.tolist() == [[1, 5, 6, 8, 9, 2], [0, 1, 7, 10, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 2, 2]]
    assert batch.response_mask.tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    assert batch.input_ids.dtype == torch.long and batch.response_mask.dtype == torch.float32


def test_build_sequence_batch_int32_arrays_same_tensors_as_lists() -> None:
    prompts, responses = [[1, 5, 6], [1, 7]], [[8, 9, 2], []]
    as_arrays = build_sequence_batch(
        [np.array(p, dtype=np.int32) for p in prompts],
        [np.array(r, dtype=np.int32) for r in responses],
        pad_id=3,
    )
    as_lists = build_sequence_batch(prompts, responses, pad_id=3)

    for name in ("input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(getattr(as_arrays, name), getattr(as_lists, name)), name
    assert as_arrays.input_ids.dtype == torch.long


def test_pad_rows_float32_and_float64_arrays_and_lists_pad_and_cut() -> None:
    rows = [
        np.array([-0.5, -1.25], dtype=np.float32),
        np.array([-1.0 / 3.0], dtype=np.float64),
        [-2.0, -3.0, -4.0, -5.0],
        [],
    ]

    padded = pad_rows(rows, 3)

    assert padded.dtype == torch.float32
    expected = [[-0.5, -1.25, 0.0], [float(np.float32(-1.0 / 3.0)), 0.0, 0.0]]
    expected += [[-2.0, -3.0, -4.0], [0.0, 0.0, 0.0]]
    assert padded.tolist() == expected


def test_experience_of_decoded_binary_trajectories_same_tensors_as_lists() -> None:
    sent = [
        Trajectory(f"t{i}", 0, 0.0, [1, 2 + i], [5] * (i + 1), [-0.25] * (i + 1), 1.0, "g")
        for i in range(3)
    ]
    received = decode_binary(encode_binary(sent))
    from_wire = experience_of(received)
    from_lists = experience_of(sent)

    wire_batch = build_sequence_batch(from_wire.prompt_ids, from_wire.response_ids, pad_id=PAD)
    list_batch = build_sequence_batch(
        [t.prompt_ids.tolist() for t in sent], [t.response_ids.tolist() for t in sent], pad_id=PAD
    )
    assert torch.equal(wire_batch.input_ids, list_batch.input_ids)
    assert torch.equal(
        pad_rows(from_wire.behaviour_logprobs, 3), pad_rows(from_lists.behaviour_logprobs, 3)
    )
