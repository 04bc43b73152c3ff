"""POST /v1/completions: text (or token ids) in, text out (constrained by a schema, regex, choice or grammar
when asked). With `echo` the prompt comes back before the completion, with its tokens' logprobs when
`logprobs` is set (what lm-evaluation-harness's loglikelihood tasks read); `max_tokens` 0 then returns the
prompt alone (the engine samples one token, which is dropped)."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Optional, Union

from fastapi import Request
from fastapi.responses import Response

from ..engine.outputs import RequestError, RequestOutput
from ..engine.sequence import TokenLogprob
from .errors import bad_request
from .formatting import Envelope, Formatter, json_logprob, new_logprobs
from .generation import parse_request, respond, sampling_params
from .protocol import CompletionRequest
from .state import ServerState
from .structured import check_grammar, guided_param

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@dataclass(frozen=True)
class Echo:
    """The prompt a choice begins with: its text (as sent, or its ids decoded), its token ids, whether the
    completion is dropped (max_tokens 0), and the alternatives its logprobs list (the request's logprobs)."""

    text: str
    token_ids: list[int]
    prompt_only: bool
    top: int


class CompletionFormatter(Formatter):
    object = chunk_object = "text_completion"

    def __init__(self, *args, echo: Optional[Echo] = None, prompt_logprobs: Optional[int] = None, **kwargs):
        """prompt_logprobs: vLLM's field, the alternatives each prompt token's entry lists (None: no field)."""
        super().__init__(*args, **kwargs)
        self.text_offset = 0
        self.echo = echo
        self.prompt_logprobs = prompt_logprobs
        self.echoed = False  # streamed: the prompt went out with the first chunk
        self.first = True  # streamed: the next chunk is the choice's first

    def count(self, out: RequestOutput) -> int:
        return 0 if self.echo is not None and self.echo.prompt_only else out.num_output_tokens

    def chunk(self, out: RequestOutput) -> Optional[dict]:
        text, tokens = out.new_text, new_logprobs(out)
        if self.echo is not None and self.echo.prompt_only:
            text, tokens = "", []
        if self.echo is not None and not self.echoed:
            self.echoed = True
            text, tokens = self.echo.text + text, self._prompt_tokens(out) + tokens
        logprobs = self._logprobs(tokens) if self.logprobs else None
        if not text and not (logprobs and logprobs["tokens"]) and not out.finished:
            return None
        choice = self._choice(text, logprobs, out.finish_reason)
        if self.first and self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(out)
        self.first = False
        return self.envelope.wrap(self.chunk_object, [choice])

    def end_chunk(self, finish_reason: str) -> dict:
        return self.envelope.wrap(self.chunk_object, [self._choice("", None, finish_reason)])

    def choice(self, out: RequestOutput) -> dict:
        text, tokens = out.text, list(zip(out.token_ids, out.logprobs))
        if self.echo is not None:
            kept = not self.echo.prompt_only
            text = self.echo.text + (text if kept else "")
            tokens = self._prompt_tokens(out) + (tokens if kept else [])
        choice = self._choice(text, self._logprobs(tokens) if self.logprobs else None, out.finish_reason)
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(out)
        return choice

    def _prompt_logprobs(self, out: RequestOutput) -> list[Optional[dict]]:
        """vLLM's shape: per prompt token, null for the first, else {token id: {logprob, rank, decoded_token}}
        for the token and its top alternatives."""
        entries: list[Optional[dict]] = []
        for token_id, lp in zip(out.prompt_token_ids, out.prompt_logprobs):
            if lp is None:
                entries.append(None)
                continue
            top = lp.top[:self.prompt_logprobs]
            entry = {str(t): {"logprob": json_logprob(v), "rank": rank, "decoded_token": self.token_text(t)}
                     for rank, (t, v) in enumerate(top, 1)}
            entry[str(token_id)] = {"logprob": json_logprob(lp.logprob), "rank": lp.rank,
                                    "decoded_token": self.token_text(token_id)}
            entries.append(entry)
        return entries

    def _prompt_tokens(self, out: RequestOutput) -> list[tuple[int, Optional[TokenLogprob]]]:
        """(token id, logprob) of each prompt token (the first's None), when logprobs were asked for."""
        if not self.logprobs:
            return []
        top = self.echo.top  # prompt_logprobs may have asked the engine for more
        return [(t, lp if lp is None else TokenLogprob(lp.logprob, lp.top[:top], lp.rank))
                for t, lp in zip(self.echo.token_ids, out.prompt_logprobs)]

    def _choice(self, text: str, logprobs: Optional[dict], finish_reason: Optional[str]) -> dict:
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, tokens: list[tuple[int, Optional[TokenLogprob]]]) -> dict:
        """The completions logprobs shape: parallel lists, top alternatives as {token: logprob}; an echoed
        prompt's first token has null for both."""
        texts = [self.token_text(token_id) for token_id, _ in tokens]
        offsets = []
        for text in texts:
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {"tokens": texts,
                "token_logprobs": [None if lp is None else json_logprob(lp.logprob) for _, lp in tokens],
                "top_logprobs": [None if lp is None else {self.token_text(t): json_logprob(v) for t, v in lp.top}
                                 for _, lp in tokens],
                "text_offset": offsets}


async def create_completion(request: Request, state: ServerState) -> Response:
    """One prompt or a list of them (as vLLM): choice prompt x n + j is prompt's choice j."""
    engine, req = await parse_request(request, state, CompletionRequest)
    prompts, echoes = [], []
    for i, prompt in enumerate(req.prompts):
        param = "prompt" if len(req.prompts) == 1 else f"prompt.{i}"
        try:
            prompt_ids = req.truncated(engine.engine.tokenize(prompt), engine.engine.config.model.max_model_len)
        except RequestError as e:
            raise bad_request(str(e), param) from None
        max_tokens = req.max_tokens or (1 if req.max_tokens == 0 else None)  # 0: one token, dropped
        wanted = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
        params = sampling_params(engine, req, prompt_ids, param, max_tokens, DEFAULT_MAX_TOKENS, req.logprobs,
                                 prompt_logprobs=max(wanted) if wanted else None)
        prompts.append((prompt_ids, params))
        shown = prompt if req.truncate_prompt_tokens is None else prompt_ids  # echo what the model saw
        echoes.append(_echo(engine.tokenizer, shown, prompt_ids, req.max_tokens == 0, req.logprobs or 0)
                      if req.echo else None)
    await check_grammar(engine.tokenizer, prompts[0][1], guided_param(req))
    envelope = Envelope(f"cmpl-{uuid.uuid4().hex}", state.model_name)
    names = state.token_names(req)
    formatters = [CompletionFormatter(envelope, names, req.logprobs is not None, i * req.num_choices + j,
                                      echo=echoes[i], prompt_logprobs=req.prompt_logprobs)
                  for i in range(len(prompts)) for j in range(req.num_choices)]
    return await respond(request, state, req, prompts, formatters, options=state.request_options(req))


def _echo(tokenizer, prompt: Union[str, list[int]], prompt_ids: list[int], prompt_only: bool, top: int) -> Echo:
    text = prompt if isinstance(prompt, str) else (tokenizer.decode(prompt_ids) if tokenizer is not None else "")
    return Echo(text, prompt_ids, prompt_only, top)
