"""A small, deterministic RolloutBatch for trainer tests."""

from __future__ import annotations

import torch

from rollout.batch import RolloutBatch


def random_train_batch(vocab_size: int, num_prompts: int = 3, group_size: int = 2,
                       seed: int = 0, first_group: int = 0, per_token: bool = False
                       ) -> RolloutBatch:
    """Groups with uneven prompt and response lengths (one empty-mask sample).
    ``per_token``: an advantage per token and fractional weights m_it (1, 0.5 or 0.25)."""
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
            masks.append(torch.tensor([1.0, 0.5, 0.25])[torch.randint(
                0, 3, (length,), generator=gen)].tolist() if per_token else [1] * length)
            groups.append(first_group + g)
    masks[1] = [0] * len(masks[1])  # a sample with no valid token still counts in N
    rewards = torch.rand(len(prompts), generator=gen)
    advantages = ([torch.randn(len(r), generator=gen).tolist() for r in responses]
                  if per_token else (rewards - rewards.mean()).tolist())
    return RolloutBatch.from_samples(prompts, responses, log_probs, rewards.tolist(),
                                   advantages, groups, group_size, response_masks=masks)


def sampled_train_batch(model_path: str, temperature: float, num_prompts: int = 4,
                        group_size: int = 2, max_new_tokens: int = 10, seed: int = 0,
                        engine_config: object = None, engine: object = None) -> RolloutBatch:
    """A batch the torch engine sampled at ``temperature``, with the engine's log-probs
    (``engine_config``: a ``TorchEngineConfig``, default 8 rows on the CPU in fp32;
    ``engine``: sample with this one instead of a fresh engine of ``model_path``)."""
    from rollout.config import SamplingConfig, TorchEngineConfig
    from rollout.engines.torch_engine import TorchEngine

    if engine is None:
        engine = TorchEngine(engine_config or TorchEngineConfig(batch_size=8), model_path)
    gen = torch.Generator().manual_seed(seed)
    prompts = [[1, *torch.randint(30, 90, (int(torch.randint(2, 7, (1,), generator=gen)),),
                                  generator=gen).tolist()] for _ in range(num_prompts)]
    prompts = [p for p in prompts for _ in range(group_size)]
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens)
    generations = engine.generate(prompts, sampling, seed=seed)
    rewards = torch.rand(len(prompts), generator=gen)
    return RolloutBatch.from_samples(
        prompts, [g.token_ids for g in generations], [g.log_probs for g in generations],
        rewards.tolist(), (rewards - rewards.mean()).tolist(),
        [i // group_size for i in range(len(prompts))], group_size)


def share_bf16_absorbs(weights: dict[str, torch.Tensor], step: float) -> float:
    """The share of ``weights`` whose bf16 value neither ``+step`` nor ``−step`` moves
    (both round back to it). AdamW's update is about lr per weight and step, so this is
    what a backend that stepped its bf16 compute copy, instead of fp32 master weights,
    would leave unchanged: the control that makes an lr-sized test discriminating."""
    absorbed = total = 0
    for weight in weights.values():
        rounded = weight.to(torch.bfloat16)
        up = (rounded.double() + step).to(torch.bfloat16) == rounded
        down = (rounded.double() - step).to(torch.bfloat16) == rounded
        absorbed += int((up & down).sum())
        total += weight.numel()
    return absorbed / total
