"""With ``kl_placement: reward`` the KL is in the rewards (rollout/kl_reward.py), not a
term of the objective: the objective production calls (trainer/objective.py) has the
value and gradient of the same loss with ``kl_coef: 0``, in float64, while the KL is
still logged; the KL as a loss term does change them (so the comparison can fail)."""

from __future__ import annotations

import torch

from tests.trainer.test_policy_losses import _objective_run
from trainer.config import LossConfig


def test_the_kl_in_the_reward_is_no_term_of_the_objective() -> None:
    in_reward = _objective_run(LossConfig(kl_coef=0.1, entropy_coef=0.01,
                                          kl_placement="reward"))
    without = _objective_run(LossConfig(kl_coef=0.0, entropy_coef=0.01))
    as_loss = _objective_run(LossConfig(kl_coef=0.1, entropy_coef=0.01))
    assert in_reward[1]["kl"] != 0 and in_reward[1]["kl"] == as_loss[1]["kl"]  # logged
    assert not torch.allclose(as_loss[2], without[2], rtol=1e-6, atol=0)
    torch.testing.assert_close(in_reward[0], without[0], rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(in_reward[2], without[2], rtol=1e-13, atol=1e-15)
