"""`kvferry replay CAPTURE... --url URL`: send captured traffic to any OpenAI-compatible server and compare."""

import asyncio
import json
import os
import sys

from kvferry.common.capture import load
from kvferry.common.errors import KvferryError
from kvferry.tools.replay.compare import build_report, format_report
from kvferry.tools.replay.sender import replay_all, replayable


def add_replay_parser(sub) -> None:
    p = sub.add_parser(
        "replay",
        help="send captured requests (--capture-dir) to a server again, and compare outputs and latencies",
        description="Exit status: 0 when every greedy or seeded output is identical and nothing failed, 1 otherwise, "
        "2 when the replay could not run (no server at --url, no readable capture).",
    )
    p.add_argument("capture", nargs="+", help="capture files or folders")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--speed", type=float, default=1.0, help="time runs this many times faster than captured")
    p.add_argument("--concurrency", type=int, default=0, help="at most this many requests at once (0: no cap)")
    p.add_argument("--model", help="send this model name instead of the captured one")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument(
        "--no-token-ids",
        dest="token_ids",
        action="store_false",
        help="do not ask for return_token_ids (for servers that refuse unknown fields); differences then place "
        "at characters only",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_replay)


def cmd_replay(args) -> int:
    if not args.speed > 0 or args.concurrency < 0:
        raise KvferryError("--speed must be above 0 and --concurrency at least 0")
    skipped: list[str] = []

    def skip(message: str) -> None:
        skipped.append(message)
        print(f"kvferry replay: skipped {message}", file=sys.stderr)

    try:
        records = [r for r in load(args.capture, skip) if replayable(r)]
    except FileNotFoundError as exc:
        raise KvferryError(str(exc)) from None
    if not records:
        raise KvferryError("no replayable request in the capture")
    run = replay_all(
        args.url.rstrip("/"), records, args.speed, args.concurrency, args.model, args.api_key, args.token_ids
    )
    answers, elapsed = asyncio.run(run)
    report = build_report(records, answers, elapsed, skipped)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if not report["differences"] and not report["errors"] else 1
