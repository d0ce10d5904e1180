"""A RolloutBatch pickles as numpy buffers (rollout/batch.py's wire format): what comes
back equals what went, derived fields included, and one read from read-only buffers (Ray's
object store maps them so) is a batch of its own that can be written."""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import torch

from rollout.batch import RolloutBatch


def _batch(old_log_probs: bool) -> RolloutBatch:
    batch = RolloutBatch.from_samples(
        [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]], [[3, 4], [4], [3, 3, 3], [4, 3]],
        [[-0.5, -1.0], [-0.2], [-1.0, -1.5, -0.1], [-0.3, -0.4]], [1.0, 0.0, 0.5, 0.25],
        [0.5, -0.5, 0.125, -0.125], [4, 4, 5, 5], 2, pad_token_id=1,
        response_masks=[[1, 1], [1], [1, 0, 1], [1, 1]], metadata={"rollout/x": 2.0},
        events=[("environment_failed", "step 0: boom")])
    return (batch.with_old_log_probs(batch.rollout_log_probs - 0.25) if old_log_probs
            else batch)


def _assert_same(got: RolloutBatch, want: RolloutBatch) -> None:
    for name, value in vars(want).items():
        other = getattr(got, name)
        if isinstance(value, torch.Tensor):
            assert other.dtype == value.dtype and torch.equal(other, value), name
        else:
            assert other == value, name


def test_a_batch_travels_as_numpy_buffers_and_comes_back_equal() -> None:
    for old in (False, True):
        batch = _batch(old)
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
        assert len(buffers) >= 11  # every tensor out of band, derived fields too
        _assert_same(pickle.loads(data, buffers=buffers), batch)
        _assert_same(pickle.loads(pickle.dumps(batch)), batch)  # in-band protocols too


def test_a_batch_from_read_only_buffers_is_copied_and_writable() -> None:
    batch = _batch(True)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    frozen = [bytes(buffer.raw()) for buffer in buffers]  # read-only, as Ray maps them
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "not writable" warning would be one
        loaded = pickle.loads(data, buffers=frozen)
    loaded.loss_mask.add_(1.0)  # its own memory: writing it touches no buffer
    loaded.input_ids[0, 0] = 42
    _assert_same(pickle.loads(data, buffers=frozen), batch)


def test_the_padded_fields_travel_as_their_spans_and_a_stray_value_sends_a_field_whole(
        ) -> None:
    batch = _batch(True)
    wide = dataclasses.replace(batch, input_ids=torch.nn.functional.pad(
        batch.input_ids, (0, 60), value=batch.pad_token_id),
        **{name: torch.nn.functional.pad(getattr(batch, name), (0, 60))
           for name in ("loss_mask", "rollout_log_probs", "old_log_probs", "advantages")})
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(wide, protocol=5, buffer_callback=buffers.append)
    dense = sum(t.numel() * t.element_size() for t in vars(wide).values()
                if isinstance(t, torch.Tensor))
    sent = sum(buffer.raw().nbytes for buffer in buffers)
    assert sent < dense / 3  # the 60 columns of padding never travel
    _assert_same(pickle.loads(data, buffers=buffers), wide)
    log_probs = wide.rollout_log_probs.clone()
    log_probs[0, 0] = -0.0  # outside the response: not the padding, bit for bit
    old = wide.old_log_probs.clone()
    old[1, -1] = 0.5
    strays = dataclasses.replace(wide, rollout_log_probs=log_probs, old_log_probs=old)
    back = pickle.loads(pickle.dumps(strays, protocol=5))
    _assert_same(back, strays)
    assert torch.equal(back.rollout_log_probs.view(torch.int32), log_probs.view(torch.int32))
