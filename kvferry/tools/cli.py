"""The `kvferry` command: one entry point, one subcommand per role or tool."""

import argparse
import sys

from kvferry.common import settings
from kvferry.common.config import EngineConfig
from kvferry.common.errors import KvferryError
from kvferry.services.commands import add_service_parsers, run


def cmd_prepare(args) -> int:
    from kvferry.common.model_files import resolve_model

    print(resolve_model(args.model))
    return 0


def cmd_generate(args) -> int:
    from kvferry.common.engine import LLMEngine
    from kvferry.common.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    engine = LLMEngine(EngineConfig.from_args(args))
    request_id = engine.add_request(args.prompt, params, chat=args.chat)
    printed = ""
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            text = engine.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
            # Hold back a trailing replacement char: the next token may complete a multi-byte character.
            stable = text.rstrip("\ufffd") if not out.finished else text
            if stable.startswith(printed):
                sys.stdout.write(stable[len(printed) :])
                sys.stdout.flush()
                printed = stable
            if out.finished:
                print(
                    f"\n[{len(out.output_token_ids)} tokens, finish: {out.finish_reason.name.lower()}]", file=sys.stderr
                )
    return 0


def cmd_keys(args) -> int:
    from kvferry.common import curve

    if args.role and not args.client:
        raise KvferryError("--role goes with --client NAME")
    if args.revoke:
        for path in curve.revoke(args.folder, args.revoke):
            print(f"removed {path}")
        print("restart the servers (the gateway; decode workers for a prefill key): they then refuse it")
        return 0
    if args.client:
        if not args.role:
            raise KvferryError(
                "--client NAME needs --role prefill or --role decode: it decides where the key is admitted"
            )
        written = curve.add_client(args.folder, args.client, args.role)
    else:
        written = curve.generate(args.folder)
    for path in written:
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvferry", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="convert the model once into the cache and print its folder")
    settings.add_arguments(p, settings.PREPARE)
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("generate", help="offline, in-process generation")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="the request's own seed")
    p.add_argument("--ignore-eos", action="store_true")
    settings.add_arguments(p, settings.GENERATE)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "keys",
        help="write CURVE key pairs into a folder, for --curve-keys",
        description="Without options: a new deployment's keys, a pair for the servers and one per worker role. "
        "--client NAME --role ROLE adds one worker's own pair; --revoke NAME takes one out again.",
    )
    p.add_argument("folder")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--client", metavar="NAME", help="add a client pair for one worker (give it --curve-client NAME)")
    what.add_argument("--revoke", metavar="NAME", help="remove a client key; restart the servers to refuse it")
    p.add_argument("--role", choices=("prefill", "decode"), help="with --client: the worker's role")
    p.set_defaults(func=cmd_keys)

    add_service_parsers(sub)

    from kvferry.tools.bench.cli import add_bench_parser
    from kvferry.tools.gpu_check.driver import add_gpu_check_parser
    from kvferry.tools.replay.cli import add_replay_parser
    from kvferry.tools.sim.cli import add_sim_parsers
    from kvferry.tools.trace.cli import add_trace_parser

    add_bench_parser(sub)
    add_trace_parser(sub)
    add_replay_parser(sub)
    add_sim_parsers(sub)
    add_gpu_check_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("generate", "bench", "prepare", "keys"):  # services set up their own logs (observe)
        from kvferry.common.logs import setup_logging

        setup_logging("text", args.command)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
