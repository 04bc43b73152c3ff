"""The server's own options (the engine's come from `EngineConfig`). Plain Python: the CLI imports this
module to build `specserve serve`'s flags without importing fastapi."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Optional

from ..config import ConfigError

# the parsers (server/tool_parsers.py), and SGLang's names for two of them
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "qwen3_coder", "pythonic", "qwen25", "llama3")
REASONING_PARSERS = ("qwen3", "deepseek-r1")


def _opt(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class ServerOptions:
    host: str = _opt("127.0.0.1", "address to bind (loopback by default)")
    port: int = _opt(8000, "TCP port to bind")
    api_key: Optional[str] = _opt(None, "require `Authorization: Bearer KEY` on all but /health, /metrics, "
                                        "/version and the API docs")
    served_model_name: Optional[str] = _opt(None, "model name clients send (default: --model as given)")
    max_queued_requests: int = _opt(1024, "requests that may wait beyond max_num_seqs; more get 429")
    shutdown_timeout: float = _opt(30.0, "seconds in-flight requests may run after SIGTERM before abort")
    access_log: bool = _opt(True, "log one line per request: client, method, path, status, duration (on by "
                                  "default, as in uvicorn: --no-access-log turns it off)")
    tool_call_parser: Optional[str] = _opt(None, "turn tool calls in chat output into tool_calls (qwen25 and llama3 "
                                                 "are SGLang's names for hermes and llama3_json)", TOOL_CALL_PARSERS)
    enable_auto_tool_choice: bool = _opt(False, "vLLM's flag, accepted: --tool-call-parser alone lets requests "
                                                "use tool_choice auto here")
    reasoning_parser: Optional[str] = _opt(None, "split <think>...</think> into reasoning_content",
                                           REASONING_PARSERS)
    max_body_bytes: int = _opt(4 * 2**20, "largest request body accepted; larger ones get 413")
    strict_request_fields: bool = _opt(False, "refuse unknown request fields with 400 (default: ignore them, "
                                              "with a warning naming them, as vLLM does)")
    allowed_origins: Optional[str] = _opt(None, "comma-separated origins whose web pages may call the API (CORS; "
                                                "'*' for any); none by default")
    return_tokens_as_token_ids: bool = _opt(False, "logprobs name each token 'token_id:N' instead of its text, "
                                                   "for tokens whose text is no valid UTF-8 alone (vLLM's flag; a "
                                                   "request's return_tokens_as_token_ids overrides it)")
    enable_prompt_tokens_details: bool = _opt(False, "usage carries prompt_tokens_details.cached_tokens, the prompt "
                                                     "tokens found in the prefix cache (vLLM's flag)")
    responses_store_size: int = _opt(0, "keep the latest N /v1/responses responses in memory, for "
                                        "previous_response_id and GET / DELETE /v1/responses/{id} (vLLM's "
                                        "VLLM_ENABLE_RESPONSES_API_STORE); 0: none, every request sends its whole "
                                        "conversation")
    allow_runtime_lora_updating: bool = _opt(False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                                                    "(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): clients may then load "
                                                    "adapters from this machine's disk")

    @property
    def origins(self) -> list[str]:
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"option port must be in [0, 65535], got {self.port}")
        if self.max_queued_requests < 0:
            raise ConfigError(f"option max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.shutdown_timeout < 0:
            raise ConfigError(f"option shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.responses_store_size < 0:
            raise ConfigError(f"option responses_store_size must be >= 0, got {self.responses_store_size}")
        if self.max_body_bytes < 1:
            raise ConfigError(f"option max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.api_key == "":
            raise ConfigError("option api_key may not be empty")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("option enable_auto_tool_choice needs tool_call_parser (which parser reads the calls)")


def add_server_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per ServerOptions field but those in `skip`: `--max-queued-requests` is `max_queued_requests`."""
    group = parser.add_argument_group("server")
    for f in fields(ServerOptions):
        if f.name in skip:
            continue
        kind = f.type.replace("Optional[", "").rstrip("]")
        if kind == "bool":  # --flag and --no-flag, as uvicorn's --access-log / --no-access-log
            group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=f.metadata["help"])
            continue
        caster = {"int": int, "float": float}.get(kind, str)
        default = f" (default: {f.default})" if f.default is not None and f.name != "api_key" else ""
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=caster, default=f.default,
                           choices=f.metadata["choices"], help=f.metadata["help"] + default)


def server_options(args: argparse.Namespace) -> ServerOptions:
    """The options of the flags `args` has (the others keep their defaults)."""
    return ServerOptions(**{f.name: getattr(args, f.name) for f in fields(ServerOptions) if hasattr(args, f.name)})
