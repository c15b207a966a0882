"""`kvferry bench ab`'s earlier names: `bench feature --feature X`, `bench tracing` and `bench capture` parse to the
same command and feature as `bench ab --feature X` (the loop itself: tests/e2e/test_bench_ab.py)."""

from kvferry.tools.cli import build_parser


def test_the_earlier_names_are_the_ab_command():
    parse = build_parser().parse_args
    for feature in ("tracing", "capture"):
        ab = parse(["bench", "ab", "--feature", feature])
        for argv in (["bench", "feature", "--feature", feature], ["bench", feature]):
            old = parse(argv)
            assert (old.func, old.feature, old.decode_threads) == (ab.func, feature, None)
    assert parse(["bench", "feature", "--feature", "prefix-caching"]).func is ab.func
