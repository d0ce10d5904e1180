"""LLM judges (``rollout.reward`` part of ``type: judge``): a language model asked to grade
each response, greedily, and its answer parsed into a score.

    template.format(prompt, response, label) ─► judge (a user message under its chat
        template) ─► greedy answer ─► parse (rollout/judge_parse.py): ``0-10`` (the last
                                            number standing as a score, / 10), ``yes-no``
                                            (first word: yes 1, no 0), a regex (its first
                                            group, a finite float, within {min, max})

The judge runs in torch engine actors of the job's gang (:class:`JudgeEngine`: the
rollout engine with one more verb), or on an OpenAI-compatible server at ``url`` through
its chat endpoint (the server applies the chat template; retries, backoff, the key and
the concurrency limit are rollout/remote.py's). An answer that
does not parse scores 0 and is counted (``reward/<name>/unparsed``).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rollout.config import SamplingConfig
from rollout.engines.torch_engine import TorchEngine
from rollout.judge_parse import parse_score as parse_score  # its home; kept importable here
from rollout.remote import CallTally, RemoteSettings, post_json, read_api_key
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


def chat_endpoint(url: str) -> str:
    """The chat endpoint of a server's base URL (``http://host:port`` or ``…/v1``)."""
    base = url.rstrip("/")
    return f"{base}/chat/completions" if base.endswith("/v1") else \
        f"{base}/v1/chat/completions"


def ask_server(config: JudgeConfig, requests: list[str], workers: int | None = None,
               tally: CallTally | None = None) -> list[str | None]:
    """Each request's greedy answer from the OpenAI-compatible server at ``config.url``
    (``/v1/chat/completions``, model ``server_model``, the key of ``api_key_env`` or
    ``api_key_file`` as a bearer token) through rollout/remote.py: each call bounded by
    ``timeout_s``, retried ``max_retries`` times with backoff, at most
    ``max_concurrency`` in flight. A call that still fails answers None (its sample is
    unscored), counted in ``tally``."""
    assert config.url is not None
    settings = RemoteSettings(
        chat_endpoint(config.url), config.timeout_s, config.max_retries, config.backoff_s,
        config.max_concurrency, read_api_key(config.api_key_env, config.api_key_file,
                                             f"reward {config.part_name}"))
    tally = tally if tally is not None else CallTally()

    def one(request: str) -> str | None:
        reply = post_json(settings, {
            "model": config.server_model, "temperature": 0.0,
            "max_tokens": config.max_new_tokens,
            "messages": [{"role": "user", "content": request}]}, tally, num_samples=1)
        if reply is None:
            return None
        try:
            return str(reply["choices"][0]["message"]["content"] or "")
        except (KeyError, IndexError, TypeError):  # a 200 that is no chat completion
            tally.failed(1, f"{settings.url}: a reply without choices[0].message.content",
                         refused=True)
            return None

    with ThreadPoolExecutor(max_workers=workers or config.max_concurrency) as pool:
        return list(pool.map(one, requests))
