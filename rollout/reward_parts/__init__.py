"""Reward parts: every entry of ``rollout.reward`` behind one interface
(:class:`RewardPart`, base.py), one file per type, chosen by kind (registry.py):

    rules.py    exact_match, numeric, boxed; a user's function (custom_function)
    model.py    a reward model served by actors in the gang
    judge.py    an LLM judge: engine actors in the gang, or a server at ``url``
    http.py     a remote scalar reward endpoint (OpenRLHF's remote_rm_url shape)
    custom.py   a user's class (class_path), a :class:`CustomReward` subclass

:class:`Rewarder` (rewarder.py) combines them into each sample's weighted reward.
"""

from rollout.reward_parts.base import PartScores, RewardPart, RewardShard
from rollout.reward_parts.custom import CustomReward, load_reward_class
from rollout.reward_parts.model import RunningMoments
from rollout.reward_parts.registry import (
    PART_TYPES,
    build_parts,
    reward_actor_bundles,
    start_reward_actors,
)
from rollout.reward_parts.rewarder import Rewarder, RewardScores

__all__ = ["PART_TYPES", "CustomReward", "PartScores", "RewardPart", "RewardScores",
           "RewardShard", "Rewarder", "RunningMoments", "build_parts", "load_reward_class",
           "reward_actor_bundles", "start_reward_actors"]
