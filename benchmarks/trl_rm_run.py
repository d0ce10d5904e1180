"""TRL's side of benchmarks/rm_vs_trl.py: ``RewardTrainer`` on the pairs it is handed.

Runs in TRL's own virtual environment (benchmarks/vs_trl.py's ``ensure_trl_venv``), never
imports Tally. Reads one JSON spec (argv[1]) written by rm_vs_trl.py:

    {"model": folder, "output_dir": folder, "pairs": [{"prompt", "chosen", "rejected"}...]
     in the order Tally's steps draw them (steps × pairs_per_step rows), "steps",
     "pairs_per_step", "lr", "warmup_steps", "min_lr_ratio", "grad_clip", "max_length",
     "threads", "gradient_checkpointing"}

and trains one step per ``pairs_per_step`` rows in that order (a sequential sampler, no
shuffling), AdamW (weight decay 0, betas 0.9/0.999, eps 1e-8) with Tally's warm-up +
cosine schedule (trainer/optim.py's formula, copied: HF's cosine-with-min-lr starts its
warm-up at lr 0, Tally's at lr/warmup), gradient norm clipped, fp32, dropout off (TRL's
default). Writes ``<output_dir>/steps.json`` (each step's seconds, from the callback's
step begin to its end) and the final model to ``<output_dir>/final_model``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from torch.utils.data import SequentialSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
from trl import RewardConfig, RewardTrainer


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """trainer/optim.py: lr·(s+1)/warmup during warm-up, then cosine to min_ratio·lr."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class StepClock(TrainerCallback):
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._began = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._began)


class InOrder(RewardTrainer):
    """The rows in the order given: the pairs Tally's cursor drew, step by step."""

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    out = Path(spec["output_dir"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForSequenceClassification.from_pretrained(
        spec["model"], num_labels=1, dtype=torch.float32)
    rows = [{"prompt": [{"role": "user", "content": p["prompt"]}],
             "chosen": [{"role": "assistant", "content": p["chosen"]}],
             "rejected": [{"role": "assistant", "content": p["rejected"]}]}
            for p in spec["pairs"]]
    steps = spec["steps"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.999),
                                  eps=1e-8, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
        s, spec["warmup_steps"], steps, spec["min_lr_ratio"]))
    args = RewardConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=spec["pairs_per_step"],
        gradient_accumulation_steps=1, max_steps=steps, learning_rate=spec["lr"],
        max_grad_norm=spec["grad_clip"], max_length=spec["max_length"],
        gradient_checkpointing=spec["gradient_checkpointing"], bf16=False,
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[],
        dataloader_num_workers=0, seed=0, disable_tqdm=True, use_cpu=True)
    clock = StepClock()
    trainer = InOrder(model=model, args=args, processing_class=tokenizer,
                      train_dataset=Dataset.from_list(rows), optimizers=(optimizer, schedule),
                      callbacks=[clock])
    trainer.train()
    trainer.save_model(str(out / "final_model"))
    tokenizer.save_pretrained(str(out / "final_model"))
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    (out / "steps.json").write_text(json.dumps({"seconds": clock.seconds, "losses": losses}))


if __name__ == "__main__":
    main()
