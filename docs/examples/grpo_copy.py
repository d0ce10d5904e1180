"""GRPO written by hand over the training API: the tiny model learns to copy.

    tally serve &                                  # the controller, 127.0.0.1:8000
    python docs/examples/grpo_copy.py [URL]        # about 3 minutes on 2 CPU cores

The loop is the user's (prompts, rewards, advantages); the session samples, accumulates
gradients and steps (docs/training-api.md).
"""

import os
import statistics
import sys

from rollout.tasks import make_task_examples
from rollout.tiny import resolve_model_path
from rollout.tokenizer import load_tokenizer
from services.clients.training import TrainingClient, datum

STEPS, PROMPTS, G = int(os.environ.get("GRPO_COPY_STEPS", 100)), 32, 8
tokenizer = load_tokenizer(resolve_model_path("tiny"))
client = TrainingClient(sys.argv[1] if len(sys.argv) > 1 else None)
session = client.create_session({
    "rollout": {"model": "tiny", "sampling": {"max_new_tokens": 8},
                "dataset": {"type": "synthetic", "task": "copy"}},
    "warmup": {"enabled": True, "num_steps": 80}})  # a short SFT warm start, cached
examples = make_task_examples("copy", difficulty=1, seed=0, num=STEPS * PROMPTS)
for step in range(STEPS):
    batch = examples[step * PROMPTS:(step + 1) * PROMPTS]
    prompts = [tokenizer.encode(example.prompt) for example in batch]
    groups = session.sample(prompts, num_samples=G).result()["sequences"]
    data, rewards = [], []
    for g, (example, prompt, responses) in enumerate(zip(batch, prompts, groups, strict=True)):
        scores = [float(tokenizer.decode(r["tokens"], skip_special_tokens=True).strip()
                        == example.answer) for r in responses]
        mean, std = statistics.mean(scores), statistics.pstdev(scores)
        rewards += scores
        data += [datum(prompt, r["tokens"], (s - mean) / (std + 1e-6), r["logprobs"], g)
                 for r, s in zip(responses, scores, strict=True)]
    half = len(data) // 2  # two calls, one step: the gradient of the whole batch
    session.forward_backward(data[:half], "importance_sampling", "sample_mean")
    session.forward_backward(data[half:], "importance_sampling", "sample_mean")
    result = session.optim_step(lr=2e-3, grad_clip=1.0).result()
    print(f"step {step + 1:2d}  reward {statistics.mean(rewards):.3f}  "
          f"loss {result['loss']:+.4f}  grad norm {result['grad_norm']:.3f}", flush=True)
print("saved:", session.save("final").result()["path"])
session.close()
