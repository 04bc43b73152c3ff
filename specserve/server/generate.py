"""POST /generate: SGLang's native API, for clients and scripts written against an SGLang server.

`text` (a string or a list of them) or `input_ids` (a list of ids or a list of lists), `sampling_params` (one dict
for all, or one per prompt: max_new_tokens (default 128), temperature, top_p, top_k, min_p, the penalties,
min_new_tokens, stop, stop_token_ids, ignore_eos, skip_special_tokens, no_stop_trim, n, regex, json_schema, ebnf,
logit_bias, seed), `stream`, `lora_path` (a served adapter's name), and SGLang's logprob fields (each one value, or
one per prompt): `return_logprob`, `top_logprobs_num` (0 to `--max-logprobs`, 20), `logprob_start_len` (-1, the
default: output tokens only), `return_text_in_logprobs`. The answer, per prompt (and choice): `text`, `output_ids`
and `meta_info` (`id`, `finish_reason` {"type": "stop" | "length" | "abort", and "length" for length},
`prompt_tokens`, `completion_tokens`, `cached_tokens`: those found in the prefix cache; with return_logprob
`output_token_logprobs` and `input_token_logprobs`, [logprob, token id, text or null] per token (the prompt's from
logprob_start_len on, its first token's logprob null; none for -1, where SGLang's servers give the last prompt
token), and with top_logprobs_num `output_top_logprobs` / `input_top_logprobs`, such a list per position); one
object for one prompt, a list for a list. Streamed, each event is the object so far (cumulative text, with `index`
for a list), then `data: [DONE]`.
"""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from ..engine.outputs import RequestError, RequestOutput
from ..engine.sequence import RequestOptions, TokenLogprob
from ..sampling_params import SamplingParams, StructuredOutputsParams
from .errors import bad_request
from .formatting import Envelope, Formatter, TokenText, json_logprob
from .generation import choice_params, read_body, respond
from .state import ServerState
from .structured import check_grammar

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
# SGLang sampling_params name -> SamplingParams name (the rest: the same name)
RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "no_stop_trim": "include_stop_str_in_output"}
SAME = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
        "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "seed", "logit_bias")
CONSTRAINTS = {"regex": "regex", "json_schema": "json", "ebnf": "grammar"}
IGNORED = ("spaces_between_special_tokens",)  # SGLang's, no effect here
# a SamplingParams field (or structured_outputs.<kind>) -> SGLang's name, for errors
SGLANG_NAMES = {**{ours: theirs for theirs, ours in RENAMED.items()},
                **{f"structured_outputs.{kind}": key for key, kind in CONSTRAINTS.items()}}


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    stream: bool = False
    rid: Optional[str] = None
    lora_path: Optional[str] = None  # the name of a served LoRA adapter (SGLang's field)
    return_logprob: Optional[Union[bool, list[bool]]] = None
    top_logprobs_num: Optional[Union[int, list[int]]] = None
    logprob_start_len: Optional[Union[int, list[int]]] = None
    return_text_in_logprobs: bool = False
    token_ids_logprob: Optional[Any] = None  # refused: logprobs of chosen tokens are not computed here

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

    def logprob_ask(self, i: int, count: int, prompt_len: int, names: TokenText, limit: int
                    ) -> Optional["LogprobAsk"]:
        """What prompt i (of count) asks of logprobs, checked (limit: the engine's max_logprobs); None: nothing."""
        if self.token_ids_logprob is not None:
            raise bad_request("token_ids_logprob is not supported: ask for top_logprobs_num", "token_ids_logprob")

        def value(name: str, default):
            given = getattr(self, name)
            if isinstance(given, list):
                if len(given) != count:
                    raise bad_request(f"{count} prompts but {len(given)} values of {name}", name)
                given = given[i]
            return default if given is None else given

        if not value("return_logprob", False):
            return None
        top, start = value("top_logprobs_num", 0), value("logprob_start_len", -1)
        if not 0 <= top <= limit:
            raise bad_request(f"top_logprobs_num must be in [0, {limit}] (the server's max_logprobs), got {top}",
                              "top_logprobs_num")
        if not -1 <= start < prompt_len:
            raise bad_request(f"logprob_start_len must be -1 or a position in the prompt (its {prompt_len} tokens), "
                              f"got {start}", "logprob_start_len")
        return LogprobAsk(start, top, names if self.return_text_in_logprobs else None)


@dataclass(frozen=True)
class LogprobAsk:
    """SGLang's logprobs for one prompt: its tokens from `start` (-1: none), `top` alternatives a position, token
    texts from `names` (None: null)."""

    start: int
    top: int
    names: Optional[TokenText]

    def params(self, params: SamplingParams) -> SamplingParams:
        return dataclasses.replace(params, logprobs=self.top, prompt_logprobs=self.top if self.start >= 0 else None)

    def _entry(self, logprob: Optional[float], token_id: int) -> list:
        return [None if logprob is None else json_logprob(logprob), token_id,
                self.names(token_id) if self.names is not None else None]

    def _top(self, lp: Optional[TokenLogprob]) -> Optional[list]:
        return None if lp is None else [self._entry(v, t) for t, v in lp.top]

    def meta_info(self, out: RequestOutput) -> dict:
        """The meta_info fields of out's logprobs so far."""
        output = list(zip(out.token_ids, out.logprobs[:out.num_output_tokens]))
        prompt = list(zip(out.prompt_token_ids, out.prompt_logprobs))[self.start:] \
            if self.start >= 0 and out.prompt_logprobs is not None else []
        meta = {"input_token_logprobs": [self._entry(lp and lp.logprob, t) for t, lp in prompt],
                "output_token_logprobs": [self._entry(lp.logprob, t) for t, lp in output]}
        if self.top:
            meta.update(input_top_logprobs=[self._top(lp) for _, lp in prompt],
                        output_top_logprobs=[self._top(lp) for _, lp in output])
        return meta


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
    try:
        if len(structured) > 1:
            raise ValueError(f"{' and '.join(structured)} exclude each other: send one")
        if structured:
            kwargs["structured_outputs"] = StructuredOutputsParams(**structured)
        params = SamplingParams(**kwargs)  # checks each value's type and range
    except (ValueError, TypeError) as e:
        field = getattr(e, "param", None)  # a SamplingParamError names it
        raise bad_request(str(e), f"{param}.{SGLANG_NAMES.get(field, field)}" if field else param) from None
    if params.max_tokens > room:
        raise bad_request(f"max_new_tokens {params.max_tokens} exceeds the room left in max_model_len ({room})",
                          f"{param}.max_new_tokens")
    return params, n


class GenerateFormatter(Formatter):
    """One prompt's choice in SGLang's shape."""

    def __init__(self, envelope: Envelope, index: Optional[int], logprobs: Optional[LogprobAsk] = None):
        super().__init__(envelope, None, False, index or 0)
        self.list_index = index  # None for a single prompt
        self.ask = logprobs
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
            if self.ask is not None:
                meta.update(self.ask.meta_info(out))
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
    req = await read_body(request, GenerateRequest)
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
        where = "sampling_params" if not req.batched else f"sampling_params.{i}"
        params, n = _sglang_params(opts, core.generation.sampling, core.config.model.max_model_len - len(ids), where)
        await check_grammar(core.tokenizer, params, where)
        ask = req.logprob_ask(i, len(prompts), len(ids), state.token_text, core.max_logprobs)
        params = ask.params(params) if ask is not None else params
        for choice in choice_params(params, n):  # seeded: choice j uses seed + j, as on /v1/*
            jobs.append((ids, choice))
            formatters.append(GenerateFormatter(envelope, len(formatters) if req.batched or n > 1 else None, ask))
    if req.lora_path is not None and req.lora_path not in state.adapters:
        served = ", ".join(state.adapters) or "none"
        raise bad_request(f"unknown LoRA adapter {req.lora_path!r} (this server serves: {served})", "lora_path")
    return await respond(request, state, req, jobs, formatters, body=_body,
                         options=RequestOptions(lora=req.lora_path))


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rid: Optional[str] = None
    abort_all: bool = False


async def abort_request(request: Request, state: ServerState) -> Response:
    """SGLang's POST /abort_request: end the requests of response `rid` (a /generate `rid`, or a /v1 response's
    id), or all with `abort_all`; each answers what it has so far, finished with reason "abort"."""
    state.serving_engine()
    req = await read_body(request, AbortRequest)
    if not req.rid and not req.abort_all:
        raise bad_request("send the rid of the request to end, or abort_all: true", "rid")
    state.requests.finish(None if req.abort_all else req.rid)
    return Response(status_code=200)
