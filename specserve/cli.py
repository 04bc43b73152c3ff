"""The `specserve` command. Engine flags are generated from `EngineConfig`'s option table, so every
option has exactly one spelling: `--max-num-seqs` is `max_num_seqs`."""
from __future__ import annotations

import argparse
import difflib
import os
import sys

from .config import ConfigError, EngineConfig, option_table


class Parser(argparse.ArgumentParser):
    """argparse without abbreviations (`--max-num-seq` is not `--max-num-seqs`): an unknown flag is an error
    that suggests the closest ones; errors are one line (exit code 2)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        namespace, extra = self.parse_known_args(args, namespace)
        if extra:
            parser = self.commands.get(getattr(namespace, "command", None), self)
            parser.error(unknown_argument(extra[0], parser))
        return namespace

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def unknown_argument(arg: str, parser: argparse.ArgumentParser) -> str:
    """The error for an argument `parser` does not take, with the closest flags when it is a flag."""
    if not arg.startswith("-"):
        return f"unexpected argument {arg!r}"
    flag = arg.split("=", 1)[0]
    flags = [s for s in parser._option_string_actions if s.startswith("--")]
    close = difflib.get_close_matches(flag, flags, n=3)
    return f"unknown flag {flag}" + (f" (did you mean {', '.join(close)}?)" if close else "")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for name, (_, f) in option_table().items():
        flag = "--" + name.replace("_", "-")
        kind = f.type.replace("Optional[", "").rstrip("]")
        help_text = f.metadata["help"] + (f" (default: {f.default})" if f.default is not None else "")
        if kind == "bool":
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            caster = {"int": int, "float": float}.get(kind, str)
            group.add_argument(flag, dest=name, type=caster, default=None, choices=f.metadata.get("choices"),
                               nargs="+" if f.metadata.get("many") else None, help=help_text)
    group.add_argument("--tp", dest="tensor_parallel_size", type=int, default=None,
                       help="same as --tensor-parallel-size")


def launched_worker(config: EngineConfig) -> int | None:
    """Under torchrun, ranks other than 0 serve rank 0's engine instead: their exit code; None on rank 0."""
    from .engine.distributed import launcher_rank

    if not launcher_rank():
        return None
    from .engine.worker import run_launched

    return run_launched(config)


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options the user actually gave (defaults stay with the config)."""
    given = {name: getattr(args, name) for name in option_table() if getattr(args, name, None) is not None}
    return {name: ",".join(v) if isinstance(v, list) else v for name, v in given.items()}  # `many` options


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine.engine import LLMEngine
    from .engine.sequence import RequestOptions
    from .sampling_params import SamplingParams

    config = EngineConfig.from_options(**engine_options(args))
    code = launched_worker(config)
    if code is not None:
        return code
    engine = LLMEngine(config)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.seed if args.temperature > 0 else None, max_tokens=args.max_tokens,
                            stop=args.stop, ignore_eos=args.ignore_eos)
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)
    engine.add_request(prompt, params, "cli", RequestOptions(lora=args.lora))
    out = None
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    print()
    if out is not None:
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def add_serve_command(sub) -> None:
    """`specserve serve`: the OpenAI-compatible server; engine flags plus the server's own."""
    from .server.options import add_server_args

    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from .engine.machine import resolve_config
    from .server.options import server_options

    options = server_options(args)
    config = EngineConfig.from_options(**engine_options(args))
    if options.allow_runtime_lora_updating and not config.lora.enabled:
        raise ConfigError("--allow-runtime-lora-updating needs room for adapters: --enable-lora (with --max-loras "
                          "and --max-lora-rank as needed) or --lora-modules")
    resolve_config(config)  # a missing model folder or a bad option fails here, before the server
    code = launched_worker(config)
    if code is not None:
        return code
    try:
        from .server.serve import run
    except ImportError as e:
        raise _needs_server_extra("serve", e) from e
    return run(config, options)


# server options that mean nothing without a listening socket
NOT_FOR_BATCH = ("host", "port", "api_key", "access_log", "allowed_origins", "shutdown_timeout",
                 "allow_runtime_lora_updating")


def add_run_batch_command(sub) -> None:
    """`specserve run-batch`: a file of OpenAI batch requests through the server's routes, offline (vLLM's
    run_batch)."""
    from .server.options import add_server_args

    r = sub.add_parser("run-batch", help="run a JSONL file of OpenAI batch requests and write their responses")
    r.add_argument("-i", "--input-file", required=True,
                   help="JSONL of {custom_id, method, url, body} lines for /v1/chat/completions, /v1/completions or "
                        "/v1/responses ('-': standard input)")
    r.add_argument("-o", "--output-file", required=True,
                   help="JSONL of {id, custom_id, response, error}, one per input line, in input order "
                        "('-': standard output)")
    add_engine_args(r)
    add_server_args(r, skip=NOT_FOR_BATCH)
    r.set_defaults(func=cmd_run_batch)


def cmd_run_batch(args: argparse.Namespace) -> int:
    from .engine.machine import resolve_config
    from .server.options import server_options

    options = server_options(args)
    config = EngineConfig.from_options(**engine_options(args))
    resolve_config(config)
    code = launched_worker(config)
    if code is not None:
        return code
    if args.input_file != "-" and not os.path.isfile(args.input_file):
        raise FileNotFoundError(f"no input file {args.input_file!r} (--input-file)")
    try:
        from .server.batch import run_batch
    except ImportError as e:
        raise _needs_server_extra("run-batch", e) from e
    return run_batch(config, options, args.input_file, args.output_file)


def add_train_draft_command(sub) -> None:
    """`specserve train-draft`: train an EAGLE-3 draft head for a target (specserve.train.eagle3)."""
    t = sub.add_parser("train-draft", help="train an EAGLE-3 draft head against a frozen target")
    t.add_argument("--target", required=True, help="target model folder (config, weights, tokenizer)")
    t.add_argument("--data", required=True, nargs="+", help="raw text files")
    t.add_argument("--out", required=True, help="output folder: config.json, model.safetensors, checkpoint.pt")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--ttt-steps", type=int, default=7, help="unrolled draft steps per position")
    t.add_argument("--lr", type=float, default=5e-4, help="AdamW lr (5e-4 suits tiny drafts; EAGLE-3 uses 5e-5 at 8B)")
    t.add_argument("--lr-schedule", default="constant",
                   help="constant, or cosine: from --lr down to a tenth of it at the last step")
    t.add_argument("--warmup-steps", type=int, default=0, help="linear lr warm-up over the first N steps")
    t.add_argument("--draft-vocab-size", type=int, default=None, help="default: min(target vocab, 32000)")
    t.add_argument("--intermediate-size", type=int, default=None, help="draft MLP width (default: the target's)")
    t.add_argument("--aux-layer-ids", type=int, nargs=3, default=None, metavar="I",
                   help="the target layers (0-based) whose outputs the draft reads, low, mid, high (the checkpoint's "
                   "eagle_aux_hidden_state_layer_ids; default: EAGLE-3's 1, L/2 - 1, L - 4 for L layers)")
    t.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--self-distill", type=int, default=0, metavar="PROMPT_LEN",
                   help="train on the target's own greedy continuations of each row's first PROMPT_LEN tokens")
    t.add_argument("--save-every", type=int, default=500, help="checkpoint every N steps")
    t.add_argument("--save-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    t.add_argument("--no-progress", dest="progress", action="store_false")
    t.set_defaults(func=cmd_train_draft)


def cmd_train_draft(args: argparse.Namespace) -> int:
    from .train.eagle3 import TrainOptions, train

    opts = {k: v for k, v in vars(args).items() if k in TrainOptions.__dataclass_fields__}
    if opts.get("aux_layer_ids") is not None:
        opts["aux_layer_ids"] = tuple(opts["aux_layer_ids"])
    last = train(TrainOptions(**opts))
    if last:
        print(f"step {last['step']}: loss {last['loss']:.4f}, accuracy per step "
              + " ".join(f"{a:.3f}" for a in last["acc"]) + f" ({last['seconds']:.0f} s of training); draft written to "
              f"{args.out}")
    return 0


def add_bench_command(sub) -> None:
    """`specserve bench`: a concurrency sweep against any OpenAI-compatible server (specserve.bench)."""
    from .bench.options import add_sweep_args

    b = sub.add_parser("bench", help="measure a running OpenAI-compatible server over a concurrency sweep")
    b.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    add_sweep_args(b)
    b.add_argument("--out", help="write the results (levels and per-request records) to this JSON file")
    b.set_defaults(func=cmd_bench)


def _needs_server_extra(command: str, e: ImportError) -> ConfigError:
    return ConfigError(f"`specserve {command}` needs the server extra ({e.name} is missing): "
                       f"pip install 'specserve[server]'")


def cmd_bench(args: argparse.Namespace) -> int:
    import asyncio

    from .bench.options import sweep_options
    try:
        from .bench.client import BenchError
        from .bench.report import print_levels, write_json
        from .bench.runner import run_sweep
    except ImportError as e:
        raise _needs_server_extra("bench", e) from e

    try:
        result = asyncio.run(run_sweep(args.base_url, sweep_options(args)))
    except BenchError as e:
        print(f"specserve bench: error: {e}", file=sys.stderr)
        return 1
    print_levels(result["levels"], title=f"{result['model']} at {args.base_url}")
    if args.out:
        write_json(args.out, result)
    return 0


def add_compare_command(sub) -> None:
    """`specserve compare`: start a server per configuration and run the same sweep against each."""
    from .bench.options import add_sweep_args

    c = sub.add_parser("compare", help="run the bench sweep against one specserve server per configuration")
    c.add_argument("--config", action="append", default=[], metavar="NAME='FLAGS'",
                   help="a configuration: `specserve serve` flags (repeatable; default: plain, chain, adaptive "
                        "on the default model, with a sweep sized for a small CPU)")
    c.add_argument("--model", dest="server_model", help="model folder every server loads (default: the shipped one)")
    add_sweep_args(c, model_name=False)
    c.add_argument("--plot", help="write a PNG of output tokens/s against concurrency")
    c.add_argument("--markdown", help="write the side-by-side table as markdown")
    c.add_argument("--out", help="write every configuration's results to this JSON file")
    c.add_argument("--startup-timeout", type=float, default=300, help="seconds a server may take to load (300)")
    c.add_argument("--log-dir", help="where the servers' logs go (default: a temporary folder, removed at the end "
                   "unless a server failed)")
    c.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .bench.options import sweep_options
    try:
        from .bench import compare
        from .bench.report import print_table, write_json
    except ImportError as e:
        raise _needs_server_extra("compare", e) from e

    configs = [compare.Configuration.parse(text) for text in args.config] or list(compare.DEFAULT_CONFIGURATIONS)
    options = sweep_options(args, base=compare.SMALL_CPU_SWEEP) if not args.config else sweep_options(args)
    try:
        result = compare.run_compare(configs, options, args.server_model, args.log_dir, args.startup_timeout)
    except KeyboardInterrupt:
        print("specserve compare: interrupted (the running server was stopped)", file=sys.stderr)
        return 130
    console = Console()
    print_table(compare.comparison_table(result), console)
    for line in compare.not_run(result):
        console.print(f"not run: {line}", markup=False, soft_wrap=True)
    if args.out:
        write_json(args.out, result)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(compare.comparison_markdown(result))
    if args.plot:
        compare.plot_throughput(result, args.plot)
    return 0 if any(c["result"] for c in result["configurations"]) else 1


def build_parser() -> Parser:
    parser = Parser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt, streamed to the terminal")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--lora", help="run the prompt with this LoRA adapter (a name given in --lora-modules)")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    add_serve_command(sub)
    add_run_batch_command(sub)
    add_train_draft_command(sub)
    add_bench_command(sub)
    add_compare_command(sub)
    parser.commands = sub.choices
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
