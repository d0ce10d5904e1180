"""A small, deterministic TrainBatch for trainer tests."""

from __future__ import annotations

import torch

from rollout.batch import TrainBatch


def random_train_batch(vocab_size: int, num_prompts: int = 3, group_size: int = 2,
                       seed: int = 0, first_group: int = 0) -> TrainBatch:
    """Groups with uneven prompt and response lengths (one empty-mask sample)."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses, log_probs, masks, groups = [], [], [], [], []
    for g in range(num_prompts):
        prompt = torch.randint(3, vocab_size, (int(torch.randint(2, 6, (1,), generator=gen)),),
                               generator=gen).tolist()
        for _ in range(group_size):
            length = int(torch.randint(1, 9, (1,), generator=gen))
            prompts.append(prompt)
            responses.append(torch.randint(3, vocab_size, (length,), generator=gen).tolist())
            log_probs.append((-torch.rand(length, generator=gen) * 3).tolist())
            masks.append([1] * length)
            groups.append(first_group + g)
    masks[1] = [0] * len(masks[1])  # a sample with no valid token still counts in N
    rewards = torch.rand(len(prompts), generator=gen)
    advantages = rewards - rewards.mean()
    return TrainBatch.from_samples(prompts, responses, log_probs, rewards.tolist(),
                                   advantages.tolist(), groups, group_size,
                                   response_masks=masks)
