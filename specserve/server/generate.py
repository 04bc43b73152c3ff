"""POST /generate: SGLang's native API, for clients and scripts written against an SGLang server.

`text` (a string or a list of them) or `input_ids` (a list of ids or a list of lists), `sampling_params` (one
dict for all, or one per prompt: max_new_tokens (default 128), temperature, top_p, top_k, min_p, the
penalties, min_new_tokens, stop, stop_token_ids, ignore_eos, skip_special_tokens, no_stop_trim, n, regex,
json_schema, ebnf, logit_bias, seed), `stream`, `lora_path` (a served adapter's name). The answer, per prompt
(and choice): `text`, `output_ids` and `meta_info` (`id`, `finish_reason` {"type": "stop" | "length" | "abort",
and "length" for length}, `prompt_tokens`, `completion_tokens`, `cached_tokens`: those found in the prefix
cache); one object for one prompt, a list for a list. Streamed, each event is the object so far (cumulative
text, with `index` for a list), then `data: [DONE]`.
"""
from __future__ import annotations

import uuid
from typing import Any, Optional, Union

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, ValidationError

from ..engine.engine import RequestError, RequestOutput
from ..engine.sequence import RequestOptions
from ..sampling_params import SamplingParams, StructuredOutputsParams
from .errors import bad_request, from_validation_error
from .formatting import Envelope, Formatter
from .generation import choice_params, respond
from .state import ServerState

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
# SGLang sampling_params name -> SamplingParams name (the rest: the same name)
RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "no_stop_trim": "include_stop_str_in_output"}
SAME = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
        "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "seed", "logit_bias")
CONSTRAINTS = {"regex": "regex", "json_schema": "json", "ebnf": "grammar"}
IGNORED = ("spaces_between_special_tokens",)  # SGLang's, no effect here


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    stream: bool = False
    rid: Optional[str] = None
    lora_path: Optional[str] = None  # the name of a served LoRA adapter (SGLang's field)

    @property
    def include_usage(self) -> bool:  # what the shared stream writer asks of an OpenAI request
        return False

    @property
    def continuous_usage(self) -> bool:
        return False

    @property
    def prompts(self) -> list[Union[str, list[int]]]:
        if (self.text is None) == (self.input_ids is None):
            raise bad_request("send text or input_ids (one of them)")
        given = self.text if self.text is not None else self.input_ids
        single = isinstance(given, str) or (given and isinstance(given[0], int))
        if not given or (not single and any(p in ("", []) for p in given)):
            raise bad_request("the prompt is empty", "text" if self.text is not None else "input_ids")
        return [given] if single else list(given)

    @property
    def batched(self) -> bool:
        given = self.text if self.text is not None else self.input_ids
        return not (isinstance(given, str) or isinstance(given[0], int))

    @property
    def num_choices(self) -> int:  # per job, as `respond` reads it: each of a prompt's n choices is a job here
        return 1


def _sglang_params(options: dict[str, Any], defaults: dict[str, Any], room: int, param: str
                   ) -> tuple[SamplingParams, int]:
    """SGLang's sampling_params as SamplingParams (what they leave out: the model's `defaults`, as on /v1/*),
    and its n."""
    options = dict(options)
    n = options.pop("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise bad_request(f"n must be an integer >= 1, got {n!r}", f"{param}.n")
    kwargs = {**defaults, "max_tokens": min(room, defaults.get("max_tokens", DEFAULT_MAX_NEW_TOKENS))}
    structured = {}
    for key, value in options.items():
        if value is None or key in IGNORED:
            continue
        if key in CONSTRAINTS:
            structured[CONSTRAINTS[key]] = value
        elif key in RENAMED or key in SAME:
            kwargs[RENAMED.get(key, key)] = value
        else:
            raise bad_request(f"unknown sampling parameter {key!r}", f"{param}.{key}")
    if kwargs["max_tokens"] > room:
        raise bad_request(f"max_new_tokens {kwargs['max_tokens']} exceeds the room left in max_model_len ({room})",
                          f"{param}.max_new_tokens")
    try:
        if len(structured) > 1:
            raise ValueError(f"{' and '.join(structured)} exclude each other: send one")
        if structured:
            kwargs["structured_outputs"] = StructuredOutputsParams(**structured)
        return SamplingParams(**kwargs), n
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), param) from None


class GenerateFormatter(Formatter):
    """One prompt's choice in SGLang's shape."""

    def __init__(self, envelope: Envelope, index: Optional[int]):
        super().__init__(envelope, None, False, index or 0)
        self.list_index = index  # None for a single prompt
        self.last: Optional[RequestOutput] = None  # streamed: the latest output

    def _object(self, out: Optional[RequestOutput], finish_reason: Optional[str]) -> dict:
        """The choice as `out` has it (None: nothing arrived yet)."""
        reason = None if finish_reason is None else {"type": finish_reason}
        if reason is not None and finish_reason == "length" and out is not None:
            reason["length"] = out.num_output_tokens
        meta = {"id": f"{self.envelope.id}-{self.index}", "finish_reason": reason}
        body = {"text": "", "output_ids": [], "meta_info": meta}
        if out is not None:
            body.update(text=out.text, output_ids=out.token_ids)
            meta.update(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                        cached_tokens=out.num_cached_tokens)
        if self.list_index is not None:
            body["index"] = self.list_index
        return body

    def chunk(self, out: RequestOutput) -> Optional[dict]:
        self.last = out
        if not out.new_text and not out.finished:
            return None
        return self._object(out, out.finish_reason)

    def end_chunk(self, finish_reason: str) -> dict:
        return self._object(self.last, finish_reason)

    def choice(self, out: RequestOutput) -> dict:
        return self._object(out, out.finish_reason)


def _body(formatters: list[GenerateFormatter], outs: list[RequestOutput], num_prompt_tokens: int):
    bodies = [f.choice(out) for f, out in zip(formatters, outs)]
    return bodies if formatters[0].list_index is not None else bodies[0]


async def generate(request: Request, state: ServerState) -> Response:
    engine = state.serving_engine()
    try:
        req = GenerateRequest.model_validate_json(await request.body())
    except ValidationError as e:
        raise from_validation_error(e) from None
    prompts = req.prompts
    options = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params or {}] * len(
        prompts)
    if len(options) != len(prompts):
        raise bad_request(f"{len(prompts)} prompts but {len(options)} sampling_params", "sampling_params")
    core, jobs, formatters = engine.engine, [], []
    envelope = Envelope(req.rid or uuid.uuid4().hex, state.model_name)
    for i, (prompt, opts) in enumerate(zip(prompts, options)):
        param = "text" if req.text is not None else "input_ids"
        try:
            ids = core.tokenize(prompt)
            core.check_prompt(ids)
        except RequestError as e:
            raise bad_request(str(e), param if not req.batched else f"{param}.{i}") from None
        params, n = _sglang_params(opts, core.generation.sampling, core.config.model.max_model_len - len(ids),
                                   "sampling_params" if not req.batched else f"sampling_params.{i}")
        for choice in choice_params(params, n):  # seeded: choice j uses seed + j, as on /v1/*
            jobs.append((ids, choice))
            formatters.append(GenerateFormatter(envelope, len(formatters) if req.batched or n > 1 else None))
    if req.lora_path is not None and req.lora_path not in state.adapters:
        served = ", ".join(state.adapters) or "none"
        raise bad_request(f"unknown LoRA adapter {req.lora_path!r} (this server serves: {served})", "lora_path")
    return await respond(request, state, req, jobs, formatters, body=_body,
                         options=RequestOptions(lora=req.lora_path))
