"""A Python client of the training API (``/api/sessions``, docs/training-api.md).

    client = TrainingClient("http://127.0.0.1:8000")
    session = client.create_session({"rollout": {"model": "tiny"}})
    fb = session.forward_backward(data, "importance_sampling", "sample_mean")
    ...                                      # the call runs while this code goes on
    step = session.optim_step(lr=1e-3).result()

Every call returns a ``concurrent.futures.Future`` at once. A session's calls run in the
order they were made (one worker thread per session sends them one after another, as
the session applies them), so a loop can queue ``forward_backward`` calls and its
``optim_step`` and do its own work (scoring, the next prompts) while they run; a
``result()`` raises :class:`TrainingAPIError` for a refused call (its ``status`` and
``detail``, which names the field). :func:`datum` builds one ``Datum`` from a prompt and
a sampled response.

Every call carries a ``request_id`` (a fresh one per call). A call that did not answer
(the connection dropped) or failed without changing anything (the session says
``"retriable": true``: a forward_backward that failed on a rank, every rank's gradient
restored), or timed out at the controller (502/504), is sent again with the same id, up
to ``retries`` times: the session applies an
id once and answers a repeat with the first answer. A ``forward_backward`` (or
``forward``) whose body is over the controller's ``server.max_request_bytes`` (learned
from the ``x-tally-max-request-bytes`` header of any answer, or from a 413) is sent as
several calls, whole groups under prompt_mean, which give the same step
(services/clients/training_split.py); the answer is merged (``metrics.parts``: how many).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx

from services.clients.training_split import merge_answers, part_body, split_data

DEFAULT_URL = "http://127.0.0.1:8000"


LIMIT_HEADER = "x-tally-max-request-bytes"
SPLITTABLE = ("forward_backward", "forward")
RETRY_WAIT_S = 0.5


class TrainingAPIError(RuntimeError):
    """A call the controller or the session refused: the HTTP status, its detail and the
    whole JSON answer (``body``: ``retriable``, a 413's ``limit``)."""

    def __init__(self, status: int, detail: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(f"{status}: {detail}")
        self.status, self.detail, self.body = status, detail, body or {}


def _answer(response: httpx.Response) -> dict[str, Any]:
    if response.status_code >= 400:
        try:
            body = response.json()
            detail = body.get("detail", response.text)
        except ValueError:
            body, detail = {}, response.text
        raise TrainingAPIError(response.status_code, str(detail),
                               body if isinstance(body, dict) else {})
    return response.json()


def datum(prompt: Sequence[int], response: Sequence[int],
          advantage: float | Sequence[float] = 0.0,
          logprobs: Sequence[float] | None = None, group: int | None = None,
          temperature: float | None = None,
          weights: Sequence[float] | None = None) -> dict[str, Any]:
    """One sequence as a Datum: prompt then response, the response's tokens trained
    (weight 1, or ``weights``: one in [0, 1] per response token), ``advantage`` on each of
    them (one number, or one per response token), ``logprobs`` the sampling log-probs of
    the response's tokens (one each), ``temperature`` the one they were sampled at (what
    ``sample`` returns with each sequence; the session refuses another than its own)."""
    if not prompt or not response:
        raise ValueError("datum: the prompt and the response need a token each")
    sequence = [*prompt, *response]
    size = len(sequence) - 1
    for name, values in (("advantage", advantage), ("weights", weights)):
        if isinstance(values, Sequence) and len(values) != len(response):
            raise ValueError(f"datum: {len(values)} {name} values for {len(response)} "
                             "response tokens")
    prompt_zeros = [0.0] * (len(prompt) - 1)
    advantages = (prompt_zeros + [float(a) for a in advantage]
                  if isinstance(advantage, Sequence) else [float(advantage)] * size)
    item: dict[str, Any] = {
        "tokens": sequence[:-1], "targets": sequence[1:],
        "weights": prompt_zeros + ([float(w) for w in weights] if weights is not None
                                   else [1.0] * len(response)),
        "advantages": advantages}
    if logprobs is not None:
        if len(logprobs) != len(response):
            raise ValueError(f"datum: {len(logprobs)} log-probs for {len(response)} "
                             "response tokens")
        item["logprobs"] = [0.0] * (len(prompt) - 1) + list(logprobs)
    if group is not None:
        item["group"] = group
    if temperature is not None:
        item["temperature"] = temperature
    return item


class Session:
    """One training session; its calls return futures, run in the order made."""

    def __init__(self, http: httpx.Client, info: dict[str, Any], token: str | None,
                 limits: dict[str, int] | None = None, retries: int = 2) -> None:
        self.id: str = info["id"]
        self.info = info
        self._http = http
        self._headers = {"content-type": "application/json",
                         **({"Authorization": f"Bearer {token}"} if token else {})}
        self._limits = limits if limits is not None else {}
        self.retries = retries
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"session-{self.id}")

    def _post(self, verb: str, body: dict[str, Any]) -> Future[dict[str, Any]]:
        return self._calls.submit(self._send, verb, body)

    def _send(self, verb: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call, split when its body is over the controller's limit (known, or
        learned from a 413)."""
        limit = self._limits.get("max_request_bytes")
        if verb in SPLITTABLE and limit is not None and len(json.dumps(body)) > limit:
            return self._send_split(verb, body, limit)
        try:
            return self._send_once(verb, body)
        except TrainingAPIError as err:
            learned = err.body.get("limit")
            if err.status != 413 or verb not in SPLITTABLE or not isinstance(learned, int):
                raise
            self._limits["max_request_bytes"] = learned
            return self._send_split(verb, body, learned)

    def _send_split(self, verb: str, body: dict[str, Any], limit: int) -> dict[str, Any]:
        parts = split_data(body, limit)
        base = body.get("request_id") or uuid.uuid4().hex
        answers = []
        for k, part in enumerate(parts):
            try:
                answers.append(self._send_once(verb, {**part_body(body, part),
                                                      "request_id": f"{base}.{k}"}))
            except TrainingAPIError as err:
                if not answers:
                    raise
                raise TrainingAPIError(err.status, f"{err.detail} (part {k + 1} of "
                                       f"{len(parts)} of a split {verb}: the {k} part(s) "
                                       "before it are applied)", err.body) from err
        return merge_answers(answers, parts)

    def _send_once(self, verb: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST with a request_id; again with the same id after a dropped connection or
        a ``retriable`` failure, up to ``retries`` times."""
        body = {**body, "request_id": body.get("request_id") or uuid.uuid4().hex}
        content = json.dumps(body).encode()  # NaN stays NaN: the server names the field
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = self._http.post(f"/api/sessions/{self.id}/{verb}",
                                           content=content, headers=self._headers)
            except httpx.TransportError:
                if last:
                    raise
                time.sleep(RETRY_WAIT_S)
                continue
            if (limit := response.headers.get(LIMIT_HEADER, "")).isdigit():
                self._limits["max_request_bytes"] = int(limit)
            try:
                return _answer(response)
            except TrainingAPIError as err:
                # retriable: the call changed nothing; 502/504: it may still run, and its
                # id makes the repeat wait for it and answer as it did
                if last or not (err.body.get("retriable") is True or err.status in (502, 504)):
                    raise
                time.sleep(RETRY_WAIT_S)
        raise AssertionError("unreachable")

    def forward_backward(self, data: list[dict[str, Any]], loss_fn: str = "cross_entropy",
                         aggregation: str | dict[str, Any] = "sample_mean",
                         **loss_settings: Any) -> Future[dict[str, Any]]:
        """Accumulate the gradient of ``data`` under ``loss_fn``; the step's denominators
        are applied at ``optim_step``. ``loss_settings``: this call's ``kl_estimator``
        and ``rollout_correction`` (the jobs' trainer.loss names). → {"loss", "logprobs",
        "metrics"}"""
        return self._post("forward_backward", _loss_body(data, loss_fn, aggregation,
                                                         loss_settings))

    def forward(self, data: list[dict[str, Any]], loss_fn: str = "cross_entropy",
                aggregation: str | dict[str, Any] = "sample_mean",
                **loss_settings: Any) -> Future[dict[str, Any]]:
        """The loss and log-probs of ``data``, no gradient (``loss_settings`` as
        :meth:`forward_backward`'s). → {"loss", "logprobs"}"""
        return self._post("forward", _loss_body(data, loss_fn, aggregation, loss_settings))

    def optim_step(self, lr: float, betas: tuple[float, float] | None = None,
                   eps: float | None = None, weight_decay: float | None = None,
                   grad_clip: float | None = None) -> Future[dict[str, Any]]:
        """One AdamW step on what the forward_backward calls since the last step
        accumulated. → {"step", "grad_norm", "loss", "metrics"}"""
        adam = {"lr": lr, **{k: v for k, v in (("betas", betas), ("eps", eps),
                                                ("weight_decay", weight_decay))
                             if v is not None}}
        body: dict[str, Any] = {"adam": adam}
        if grad_clip is not None:
            body["grad_clip"] = grad_clip
        return self._post("optim_step", body)

    def sample(self, prompt_tokens: list[list[int]], num_samples: int = 1,
               seed: int | None = None, **sampling: Any) -> Future[dict[str, Any]]:
        """``num_samples`` responses per prompt from the weights of the last step
        (``sampling``: temperature, top_p, top_k, max_new_tokens, stop; the session's
        own when none). → {"sequences": [[{"tokens", "logprobs", "finish_reason"}]]}"""
        body: dict[str, Any] = {"prompt_tokens": prompt_tokens, "num_samples": num_samples}
        if sampling:
            body["sampling"] = sampling
        if seed is not None:
            body["seed"] = seed
        return self._post("sample", body)

    def save(self, name: str) -> Future[dict[str, Any]]:
        """The weights as a Hugging Face folder (LoRA: adapters), and the trainer state
        to ``load`` again. → {"path", "step", "adapter"}"""
        return self._post("save", {"name": name})

    def load(self, name: str) -> Future[dict[str, Any]]:
        """Back to a ``save`` of this session (weights, optimizer state, step)."""
        return self._post("load", {"name": name})

    def state(self) -> dict[str, Any]:
        """Step, pending forward_backward calls, tokens and the last step's metrics."""
        return _answer(self._http.get(f"/api/sessions/{self.id}", headers=self._headers))

    def close(self) -> dict[str, Any]:
        """End the session once its queued calls are done (a call after it is refused
        by the controller: the session ended)."""
        self._calls.submit(lambda: None).result()
        return _answer(self._http.delete(f"/api/sessions/{self.id}", headers=self._headers))

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _loss_body(data: list[dict[str, Any]], loss_fn: str, aggregation: str | dict[str, Any],
               settings: dict[str, Any]) -> dict[str, Any]:
    """A forward(_backward) body; ``policy_loss`` among ``settings`` names the pg term in
    place of ``loss_fn`` (the same field under the jobs' name)."""
    named = {} if "policy_loss" in settings else {"loss_fn": loss_fn}
    return {"data": data, **named, "aggregation": _aggregation(aggregation), **settings}


def _aggregation(value: str | dict[str, Any]) -> dict[str, Any]:
    return {"mode": value} if isinstance(value, str) else dict(value)


class TrainingClient:
    """The controller at ``url`` (``TALLY_URL``, else http://127.0.0.1:8000), with the
    API token ``token`` (``TALLY_API_TOKEN``) when it requires one; ``retries``: how
    often a call that did not answer, or failed changing nothing, is sent again."""

    def __init__(self, url: str | None = None, token: str | None = None,
                 timeout_s: float | None = None, retries: int = 2) -> None:
        self.retries = retries
        self._limits: dict[str, int] = {}
        """``max_request_bytes``: the controller's body limit, once an answer said it."""
        self.url = (url or os.environ.get("TALLY_URL") or DEFAULT_URL).rstrip("/")
        self.token = token if token is not None else os.environ.get("TALLY_API_TOKEN")
        # No read timeout by default: a call waits for a starting session, and a step
        # of a big batch takes what it takes.
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(
            timeout_s, connect=10.0))

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def create_session(self, config: dict[str, Any] | None = None,
                       idle_timeout_s: float | None = None) -> Session:
        """Start a session (``config``: job-config-like, e.g. {"rollout": {"model":
        "tiny"}, "trainer": {"dp_size": 2}}); its first call waits until it is ready.
        ``idle_timeout_s``: it saves its state and ends once this long without a call
        (None: the controller's default)."""
        body: dict[str, Any] = {"config": config or {}}
        if idle_timeout_s is not None:
            body["idle_timeout_s"] = idle_timeout_s
        response = self._http.post("/api/sessions", json=body, headers=self._headers())
        if (limit := response.headers.get(LIMIT_HEADER, "")).isdigit():
            self._limits["max_request_bytes"] = int(limit)
        info = _answer(response)
        return Session(self._http, info, info.get("token") or self.token, self._limits,
                       self.retries)

    def session(self, session_id: str, token: str | None = None) -> Session:
        """A session started earlier (by this client or another, before a restart)."""
        info = _answer(self._http.get(f"/api/sessions/{session_id}",
                                      headers=self._headers()))
        return Session(self._http, info, token or self.token, self._limits, self.retries)

    def list_sessions(self) -> list[dict[str, Any]]:
        return _answer(self._http.get("/api/sessions"))["items"]

    def close(self) -> None:
        self._http.close()
