"""`python -m kvferry.tools.bench.synthetic {prefill,decode}`: one synthetic worker, a TEST DOUBLE (see __init__)."""

import argparse
import contextlib
import signal
import sys

from kvferry.common import settings
from kvferry.common.errors import KvferryError
from kvferry.common.logs import setup_logging
from kvferry.tools.bench.synthetic.model_folder import SYNTHETIC_MODEL_NAME

DESCRIPTION = (
    "TEST DOUBLE of a kvferry worker, for `kvferry bench gateway` and the tests: no model, it emits a fixed cycle of "
    f"plain-word tokens. It registers as model '{SYNTHETIC_MODEL_NAME}', which a gateway serving a real model "
    "refuses; never run it beside real workers."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvferry.tools.bench.synthetic", description=DESCRIPTION)
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--gateway", required=True, help="the gateways' control addresses, comma-separated")
    parser.add_argument(
        "--model-folder",
        required=True,
        help=f"the folder named {SYNTHETIC_MODEL_NAME} the gateway serves (bench/synthetic/model_folder.py makes one)",
    )
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--block-size", type=int, default=settings.from_env("block_size"), help="as the gateway's")
    parser.add_argument(
        "--counts-file",
        default=None,
        help="a file it keeps its send counts in, for the bench to read (bench/synthetic/send_counts.py)",
    )
    parser.add_argument(
        "--step-interval",
        type=float,
        default=0.0,
        help="decode: seconds between steps (0: as fast as the gateway takes the tokens)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("text", f"synthetic-{args.role}")
    from kvferry.tools.bench.synthetic.decode import SyntheticDecode
    from kvferry.tools.bench.synthetic.prefill import SyntheticPrefill

    try:
        if args.role == "decode":
            worker = SyntheticDecode(
                args.gateway, args.model_folder, args.worker_id, args.block_size, args.step_interval, args.counts_file
            )
        else:
            worker = SyntheticPrefill(
                args.gateway, args.model_folder, args.worker_id, args.block_size, args.counts_file
            )

        def stop(*_):
            worker.running = False

        signal.signal(signal.SIGTERM, stop)
        with contextlib.suppress(KeyboardInterrupt):
            worker.serve_forever()
    except KvferryError as exc:
        print(f"kvferry synthetic {args.role}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
