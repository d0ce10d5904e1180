"""DAPO dynamic sampling: which groups carry a learning signal.

A group whose G rewards are all equal (all right, all wrong) has zero advantage under
GRPO, so it only dilutes the step. With ``dynamic_sampling.enabled`` the manager keeps
the groups with spread max_i r_i − min_i r_i > 0 and draws fresh prompts for the rest,
at most ``max_draws`` generation rounds per step (the first included). Each round draws
only the groups still missing, so no generation is thrown away for overshoot. If the
batch is still short after the last round, the earliest zero-spread groups fill it:
the step still holds N samples in whole groups, and the metadata reports how many
filled in (``rollout/zero_spread_filled``) next to the rounds (``rollout/num_draws``).
"""

from __future__ import annotations


def has_reward_spread(group_rewards: list[float]) -> bool:
    """Whether a group's rewards differ (its GRPO advantages are not all zero); the
    rewards of its scored samples only (an unscored one is missing), so a group with
    fewer than two has none."""
    return len(group_rewards) > 1 and max(group_rewards) > min(group_rewards)


def split_by_spread(groups_rewards: list[list[float]]) -> tuple[list[int], list[int]]:
    """Indices of the groups with reward spread and of those without, each in order."""
    kept = [i for i, rewards in enumerate(groups_rewards) if has_reward_spread(rewards)]
    kept_set = set(kept)
    return kept, [i for i in range(len(groups_rewards)) if i not in kept_set]
