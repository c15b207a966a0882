"""`kvferry bench ab --feature X` is the one A/B command: every feature parses to it, and the per-feature names it
replaced (`bench feature`, `bench tracing`, `bench capture`) are gone (the loop itself: tests/e2e/test_bench_ab.py)."""

import pytest

from kvferry.tools.bench.ab import FEATURES, ONE_STACK, cmd_bench_ab
from kvferry.tools.cli import build_parser


def test_every_feature_is_the_ab_command():
    parse = build_parser().parse_args
    for feature in (*FEATURES, *ONE_STACK):
        args = parse(["bench", "ab", "--feature", feature])
        assert (args.func, args.feature, args.decode_threads) == (cmd_bench_ab, feature, None)
    for argv in (["bench", "feature", "--feature", "tracing"], ["bench", "tracing"], ["bench", "capture"]):
        with pytest.raises(SystemExit):
            parse(argv)
