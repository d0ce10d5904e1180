"""TRL's side of benchmarks/vs_trl.py: ``GRPOTrainer`` on the work a spec file describes.

Runs in the TRL virtual environment that vs_trl.py creates (trl, torch, transformers,
datasets; no Tally package, which is why the two rewards of rollout/rewards.py are
restated below). The spec names the model folder, the prompt records in the order Tally's
cursor draws them (so ``shuffle_dataset=False`` makes TRL see the same prompts at the same
steps) and the settings. Writes one JSON line per optimizer step:

    {"step": k, "step_time_s": ..., "tokens": ..., "reward_mean": ..., "end_time": ...}

Every step checks that it got the spec's prompts of that step.
``step_time_s`` runs from the Trainer's on_step_begin to on_step_end (generation, reward,
forward/backward, optimizer step); ``tokens`` are the prompt + completion tokens TRL counts
in ``state.num_input_tokens_seen``. The final weights are saved to ``<output_dir>/final``.

    <trl venv>/bin/python benchmarks/trl_grpo_run.py SPEC.json METRICS.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    TrainerCallback,
)
from trl import GRPOConfig, GRPOTrainer

# Restated from rollout/rewards.py (this environment has no Tally): keep them in step.
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
NUMERIC_TOLERANCE = 1e-6


def exact_match(texts: list[str], answers: list[str]) -> list[float]:
    return [float(t.strip() == a.strip()) for t, a in zip(texts, answers, strict=True)]


def numeric_match(texts: list[str], answers: list[str]) -> list[float]:
    rewards = []
    for text, answer in zip(texts, answers, strict=True):
        target = float(answer.replace(",", ""))
        found = _NUMBER.findall(text.replace(",", ""))
        value = float(found[-1]) if found else None
        rewards.append(float(value is not None and abs(value - target)
                             <= NUMERIC_TOLERANCE * max(1.0, abs(target))))
    return rewards


REWARDS = {"exact_match": exact_match, "numeric": numeric_match}


def load_tokenizer(path: str):
    """Tally's character tokenizer explicitly (AutoTokenizer would pick Qwen2's byte-level
    one from the model type: see rollout/tokenizer.py), any other through Auto."""
    config = json.loads((Path(path) / "tokenizer_config.json").read_text())
    if config.get("tally_tokenizer"):
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path, padding_side="left")


class StepRecorder(TrainerCallback):
    """Times each optimizer step and writes it, with the rewards the reward function saw."""

    def __init__(self, metrics_file: Path) -> None:
        self.out = metrics_file.open("w", encoding="utf-8")
        self.rewards: list[float] = []
        self.started = 0.0
        self.tokens_before = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and model.is_activation_checkpointing:
            raise RuntimeError("activation checkpointing is on; the comparison assumes it off")

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()
        self.tokens_before = state.num_input_tokens_seen

    def on_step_end(self, args, state, control, **kwargs):
        row = {"step": state.global_step, "step_time_s": time.perf_counter() - self.started,
               "tokens": state.num_input_tokens_seen - self.tokens_before,
               "reward_mean": sum(self.rewards) / max(len(self.rewards), 1),
               "end_time": time.time()}
        self.out.write(json.dumps(row) + "\n")
        self.out.flush()


def check_prompts(spec: dict, step: int, prompts: list) -> None:
    """Stop unless step ``step`` (from 0) got the spec's records of that step, each
    group_size times in a row: the same prompts Tally draws at that step."""
    count = spec["prompts_per_step"]
    expected = [r["prompt"] for r in spec["records"][step * count:(step + 1) * count]
                for _ in range(spec["group_size"])]
    if prompts != expected:
        raise RuntimeError(f"step {step + 1}: TRL drew other prompts than Tally's cursor "
                           f"(first: {prompts[0]!r}, expected {expected[0]!r})")


def grpo_config(spec: dict) -> GRPOConfig:
    """Tally's settings in TRL's names: token-mean loss (dapo), group-scaled advantages,
    no KL (beta=0), AdamW at a constant lr clipped to norm 1, fp32 on CPU, one optimizer
    step per generation of prompts_per_step × group_size samples."""
    return GRPOConfig(
        output_dir=str(Path(spec["output_dir"]) / "trainer"),
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["prompts_per_step"] * spec["group_size"],
        gradient_accumulation_steps=1,
        num_generations=spec["group_size"],
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=1.0,
        shuffle_dataset=False,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        use_cpu=True,
        bf16=False,
        fp16=False,
        activation_checkpointing=False,  # transformers 5's name; GRPOConfig's default is on
        seed=spec["seed"],
        logging_steps=10,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        log_completions=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("spec", type=Path)
    parser.add_argument("metrics", type=Path)
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())
    torch.set_num_threads(spec["threads"])
    tokenizer = load_tokenizer(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    recorder = StepRecorder(args.metrics)
    score = REWARDS[spec["reward"]]

    def reward(prompts, completions, completion_ids, answer, trainer_state, **kwargs
               ) -> list[float]:
        check_prompts(spec, trainer_state.global_step, prompts)
        # Decoded from the ids as Tally decodes them (skip_special_tokens), whatever TRL's
        # own completion parsing does with a chat template.
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        recorder.rewards = score(texts, answer)
        return recorder.rewards

    reward.__name__ = spec["reward"]
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=grpo_config(spec),
                          train_dataset=Dataset.from_list(spec["records"]),
                          processing_class=tokenizer, callbacks=[recorder])
    trainer.train()
    trainer.save_model(str(Path(spec["output_dir"]) / "final"))


if __name__ == "__main__":
    main()
