"""LLM judges (``rollout.reward`` part of ``type: judge``): a language model asked to grade
each response, greedily, and its answer parsed into a score.

    template.format(prompt, response, label) ─► judge (a user message under its chat
        template) ─► greedy answer ─► parse (rollout/judge_parse.py): ``0-10`` (the last
                                            number standing as a score, / 10), ``yes-no``
                                            (first word: yes 1, no 0), a regex (its first
                                            group, a finite float, within {min, max})

The judge runs in torch engine actors of the job's gang (:class:`JudgeEngine`: the
rollout engine with one more verb), or on an SGLang server at ``url`` through its
OpenAI-compatible chat endpoint (the server applies the chat template). An answer that
does not parse scores 0 and is counted (``reward/<name>/unparsed``).
"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rollout.config import SamplingConfig
from rollout.engines.torch_engine import TorchEngine
from rollout.judge_parse import parse_score as parse_score  # its home; kept importable here
from rollout.reward_config import JudgeConfig
from rollout.tokenizer import decode_responses, encode_prompts


def judge_request(template: str, prompt: Any, response: str, label: str | None) -> str:
    """The judge's user message for one sample (a prompt of messages: their contents,
    one per line)."""
    text = prompt if isinstance(prompt, str) else "\n".join(
        str(m.get("content", "")) for m in prompt)
    return template.format(prompt=text, response=response, label="" if label is None
                           else label)


class JudgeEngine(TorchEngine):
    """A torch engine actor serving a judge: its requests as user messages under the
    judge's chat template (when it has one), answered greedily."""

    def answer(self, requests: list[str], max_new_tokens: int) -> tuple[list[str], float]:
        """(each request's answer, the seconds it took)."""
        started = time.perf_counter()
        chat = self.tokenizer.chat_template is not None
        ids = encode_prompts(self.tokenizer, [[{"role": "user", "content": r}] if chat else r
                                              for r in requests], chat)
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens)
        generations = self.generate(ids, greedy, seed=0)
        answers = decode_responses(self.tokenizer, [g.token_ids for g in generations])
        return answers, time.perf_counter() - started


def ask_server(config: JudgeConfig, requests: list[str], workers: int = 8) -> list[str]:
    """Each request's greedy answer from the SGLang server at ``config.url``
    (``/v1/chat/completions``), each call bounded by ``config.timeout_s``."""
    assert config.url is not None

    def one(request: str) -> str:
        body = json.dumps({"model": "default", "temperature": 0.0,
                           "max_tokens": config.max_new_tokens,
                           "messages": [{"role": "user", "content": request}]}).encode()
        call = urllib.request.Request(f"{config.url.rstrip('/')}/v1/chat/completions",
                                      data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(call, timeout=config.timeout_s) as reply:
            return str(json.load(reply)["choices"][0]["message"]["content"] or "")

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, requests))
