"""`kvferry replay CAPTURE... --url URL`: send captured traffic to any OpenAI-compatible server and compare."""

import asyncio
import json
import os
import sys

from kvferry.common.capture import located_records
from kvferry.common.errors import KvferryError
from kvferry.tools.replay.compare import build_report, format_report
from kvferry.tools.replay.sender import replay_all, replayable

DEFAULT_MAX_DURATION_S = 86400.0


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
    p.add_argument(
        "--max-duration",
        type=float,
        default=DEFAULT_MAX_DURATION_S,
        metavar="S",
        help="refuse a capture whose arrivals, divided by --speed, span more than S seconds (default: a day), "
        "rather than wait that long for its last request",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_replay)


def check_duration(located: list, speed: float, max_duration_s: float) -> None:
    """Refuse, naming the first and last lines, a capture whose replay would wait past max_duration_s: an arrival
    far from the rest (a clock jump, an edited line) would otherwise hold the replay for years."""
    (first_at, first), (last_at, last) = located[0], located[-1]
    span_s = (last.arrival_unix - first.arrival_unix) / speed
    if span_s > max_duration_s:
        raise KvferryError(
            f"the capture's arrivals span {span_s:.0f} s at --speed {speed:g}, from {first_at} to {last_at}, past "
            f"--max-duration {max_duration_s:g} s: remove the line that is out of place, or raise --speed or "
            "--max-duration"
        )


def cmd_replay(args) -> int:
    if not args.speed > 0 or args.concurrency < 0 or not args.max_duration > 0:
        raise KvferryError("--speed and --max-duration must be above 0, and --concurrency at least 0")
    skipped: list[str] = []

    def skip(message: str) -> None:
        skipped.append(message)
        print(f"kvferry replay: skipped {message}", file=sys.stderr)

    try:
        located = sorted(
            ((where, r) for where, r in located_records(args.capture, skip) if replayable(r)),
            key=lambda item: item[1].arrival_unix,
        )
    except OSError as exc:  # FileNotFoundError, or a file that cannot be read
        raise KvferryError(str(exc)) from None
    if not located:
        raise KvferryError("no replayable request in the capture")
    check_duration(located, args.speed, args.max_duration)
    records = [r for _, r in located]
    run = replay_all(
        args.url.rstrip("/"), records, args.speed, args.concurrency, args.model, args.api_key, args.token_ids
    )
    answers, elapsed = asyncio.run(run)
    report = build_report(records, answers, elapsed, skipped)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if not report["differences"] and not report["errors"] else 1
