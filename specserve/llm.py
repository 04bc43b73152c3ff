"""The offline entry point: `LLM(model=...).generate(prompts, sampling_params)`."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from .config import EngineConfig
from .engine.engine import LLMEngine
from .engine.outputs import Prompt, RequestOutput
from .engine.sequence import RequestOptions
from .sampling_params import SamplingParams


class LLM:
    """A model with its engine. Options are the flat names of `EngineConfig` (unknown names are refused)."""

    def __init__(self, model: Optional[str] = None, **options):
        self.engine = LLMEngine(EngineConfig.from_options(model=model, **options))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 lora: Union[str, Sequence[Optional[str]], None] = None,
                 priority: Union[int, Sequence[int]] = 0) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished output per prompt, in order. Without
        sampling_params, the model's sampling defaults (its generation_config.json) apply. lora: the name of a
        LoRA adapter (`lora_modules`) for every prompt, or one name (or None: the base model) per prompt;
        priority: under scheduling_policy 'priority', one for all or one per prompt (lower runs first).

        Every prompt is validated before any work starts, so one bad prompt fails the call cleanly.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.engine.default_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        priorities = [priority] * len(prompts) if isinstance(priority, int) else list(priority)
        if not len(loras) == len(priorities) == len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA names and {len(priorities)} priorities")
        options = [RequestOptions(name, p) for name, p in zip(loras, priorities)]
        engine = self.engine
        for p, sp, opts in zip(prompts, sampling_params, options):
            engine.check_prompt(engine.tokenize(p))
            engine.check_options(opts)
            sp.validate()
            sp.update_from_tokenizer(engine.tokenizer)  # bad words that cannot be tokenized fail here, not half-way
        ids = [engine.add_request(p, sp, options=opts).request_id
               for p, sp, opts in zip(prompts, sampling_params, options)]
        final: dict[str, RequestOutput] = {}
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for rid in ids:
                engine.abort(rid)
            raise
        return [final[rid] for rid in ids]

    def chat(self, messages: Union[list[dict[str, Any]], Sequence[list[dict[str, Any]]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             tools: Optional[list[dict[str, Any]]] = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: Optional[dict[str, Any]] = None,
             lora: Union[str, Sequence[Optional[str]], None] = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: a conversation (a list of {"role", "content"} messages) or a list of them, each through
        the model's chat template (with `tools` and `chat_template_kwargs`, as /v1/chat/completions renders it),
        then `generate`. The outputs' text is the raw completion (no tool-call or reasoning parsing)."""
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer, so no chat template: use generate with token ids")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                list(conversation), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))  # the template wrote its own
        return self.generate(prompts, sampling_params, lora=lora)

    def update_weights(self, folder: str, load_format: str = "safetensors") -> None:
        """Generate with the weights in `folder` from now on: a checkpoint of the same architecture and shapes
        (`LLMEngine.update_weights`)."""
        self.engine.update_weights(folder, load_format)
