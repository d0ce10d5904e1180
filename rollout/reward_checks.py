"""Checks of a reward-model folder before a job starts (``rollout.reward`` part of
``type: model``): free of torch, so preflight stays light."""

from __future__ import annotations

from pathlib import Path

from rollout.pretrained import TOKENIZER_FILES
from rollout.reward_config import RewardModelConfig


def check_local_folder(value: str, field: str, what: str) -> None:
    """``value`` is a folder here. Checked before transformers reads it: given a name that
    is no folder (``org/name``, or a folder not made yet) transformers asks the Hugging
    Face hub, retrying for most of a minute on an offline machine."""
    folder = Path(value).expanduser()
    if not folder.is_dir():
        state = "is a file" if folder.exists() else "does not exist"
        raise ValueError(f"{field}: {value} {state}; name a local {what} folder (Tally does "
                         "not download models)")


class RewardModelError(ValueError):
    """A reward-model folder that cannot score: no classification head, not one label,
    no tokenizer, no chat template where one is asked for."""


def check_reward_model(config: RewardModelConfig, field: str) -> None:
    """Before anything starts: the folder is a sequence classifier with one label and a
    tokenizer (with a chat template when ``chat_template``); RewardModelError naming
    ``field`` (``rollout.reward[1]``) otherwise."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        model_config = AutoConfig.from_pretrained(config.path)
    except (OSError, ValueError) as err:
        raise RewardModelError(f"{field}.path: {config.path} is not a Hugging Face model "
                               f"folder ({err.__class__.__name__}: "
                               f"{str(err).splitlines()[0]})") from None
    architectures = model_config.architectures or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise RewardModelError(
            f"{field}.path: {config.path} has no sequence-classification head "
            f"(architectures {architectures}); a reward model is an "
            "AutoModelForSequenceClassification with one label (tally train-rm writes one)")
    if model_config.num_labels != 1:
        raise RewardModelError(f"{field}.path: {config.path} has num_labels="
                               f"{model_config.num_labels}; a reward model has one label "
                               "(its score)")
    if not any(Path(config.path).glob("*.safetensors")):
        raise RewardModelError(f"{field}.path: {config.path} has no *.safetensors weights; "
                               "Tally reads weights as safetensors only, never a pickle "
                               "(save_pretrained writes them)")
    where = config.tokenizer or config.path
    name = "tokenizer" if config.tokenizer else "path"
    missing = f"{field}.{name}: no tokenizer in {where}"
    fix = f"save the RM's tokenizer there or set {field}.tokenizer"
    if not any((Path(where) / file).is_file() for file in TOKENIZER_FILES):
        raise RewardModelError(f"{missing} (no {' or '.join(TOKENIZER_FILES)}); {fix}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError, TypeError) as err:
        raise RewardModelError(f"{missing} ({err.__class__.__name__}); {fix}") from None
    if config.chat_template and tokenizer.chat_template is None:
        raise RewardModelError(f"{field}.chat_template: the tokenizer of {where} has no "
                               "chat template")
