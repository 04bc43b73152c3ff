"""POST /v1/completions: text (or token ids) in, text out (JSON with response_format / guided_json)."""
from __future__ import annotations

import uuid
from typing import Optional

from fastapi import Request
from fastapi.responses import Response

from ..engine.engine import RequestError, RequestOutput
from ..engine.sequence import TokenLogprob
from .errors import bad_request
from .formatting import Envelope, Formatter, json_logprob, new_logprobs
from .generation import parse_request, respond, sampling_params
from .protocol import CompletionRequest
from .state import ServerState
from .structured import check_grammar, guided_param

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class CompletionFormatter(Formatter):
    object = chunk_object = "text_completion"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.text_offset = 0

    def chunk(self, out: RequestOutput) -> Optional[dict]:
        logprobs = self._logprobs(new_logprobs(out)) if self.logprobs else None
        if not out.new_text and logprobs is None and not out.finished:
            return None
        return self.envelope.wrap(self.chunk_object, [self._choice(out.new_text, logprobs, out.finish_reason)])

    def end_chunk(self, finish_reason: str) -> dict:
        return self.envelope.wrap(self.chunk_object, [self._choice("", None, finish_reason)])

    def choice(self, out: RequestOutput) -> dict:
        logprobs = self._logprobs(list(zip(out.token_ids, out.logprobs))) if self.logprobs else None
        return self._choice(out.text, logprobs, out.finish_reason)

    def _choice(self, text: str, logprobs: Optional[dict], finish_reason: Optional[str]) -> dict:
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, tokens: list[tuple[int, TokenLogprob]]) -> dict:
        """The completions logprobs shape: parallel lists, top alternatives as {token: logprob}."""
        texts = [self.token_text(token_id) for token_id, _ in tokens]
        offsets = []
        for text in texts:
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {"tokens": texts, "token_logprobs": [json_logprob(lp.logprob) for _, lp in tokens],
                "top_logprobs": [{self.token_text(t): json_logprob(v) for t, v in lp.top} for _, lp in tokens],
                "text_offset": offsets}


async def create_completion(request: Request, state: ServerState) -> Response:
    """One prompt or a list of them (as vLLM): choice prompt x n + j is prompt's choice j."""
    engine, req = await parse_request(request, state, CompletionRequest)
    prompts = []
    for i, prompt in enumerate(req.prompts):
        param = "prompt" if len(req.prompts) == 1 else f"prompt.{i}"
        try:
            prompt_ids = engine.engine.tokenize(prompt)
        except RequestError as e:
            raise bad_request(str(e), param) from None
        prompts.append((prompt_ids, sampling_params(engine, req, prompt_ids, param, req.max_tokens,
                                                    DEFAULT_MAX_TOKENS, req.logprobs)))
    await check_grammar(engine.tokenizer, prompts[0][1], guided_param(req))
    envelope = Envelope(f"cmpl-{uuid.uuid4().hex}", state.model_name)
    formatters = [CompletionFormatter(envelope, state.token_text, req.logprobs is not None, index)
                  for index in range(len(prompts) * req.num_choices)]
    return await respond(request, state, req, prompts, formatters)
