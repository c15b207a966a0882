"""`kvferry gateway --gateways N`: N gateway processes behind one HTTP port, started and watched by this process,
which serves nothing itself. Each child is a whole gateway (`kvferry gateway --gateway-index I`) with its own
control port (common/gateway_ports.py); workers are given the list of them.

Signals go on to every child: SIGTERM drains each (a second one stops each at once), Ctrl-C stops them. A signal sent
to the whole process group reaches each child twice, from the sender and from us: the child takes the second as the
same stop (stop_signals.py). Stopped so, this process exits 0. When one child exits of its own accord the others are
stopped too, and this process exits 1, so that whatever supervises it restarts the group whole rather than leave it
serving with fewer processes than asked. A child gets SIGTERM when this process dies, even by SIGKILL (spawn).
"""

import logging
import os
import signal
import subprocess
import time

from kvferry.common import settings
from kvferry.common.bind_check import check_exposed, check_http_exposed
from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.gateway_ports import check_gateway_ports, control_addresses
from kvferry.common.logs import setup_logging
from kvferry.common.model_files import resolve_model
from kvferry.common.setting import from_args
from kvferry.services.launcher import spawn, stop_all

log = logging.getLogger("kvferry.gateway")
# How a child ends when a stop signal reaches it: drained (0), by Ctrl-C (130, `kvferry`'s status for it), or by the
# signal itself (uvicorn raises it again once it has shut down, after a second SIGTERM).
ENDED_BY_A_STOP = (0, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT)


def run_gateway_group(args) -> int:
    config = from_args(GatewayConfig, args)
    setup_logging(args.log_format, "gateway-group")
    # Refused here, before any child starts: each would refuse it too, N times over.
    check_http_exposed(config.host, config.port, config.api_key, args.insecure)
    controls = control_addresses(config.control, config.gateways)
    if not args.insecure:  # with it, each child warns as it binds
        for control in controls:
            check_exposed(control, "the gateway's control socket", curve=bool(args.curve_keys))
    check_gateway_ports(config.host, config.port, controls)
    resolve_model(args.model)  # convert once here, not in N processes at the same time
    # Each child reads this command's settings from the environment, as it got them; --control its own.
    env = settings.apply_environment(
        dict(os.environ), settings.child_environment(args, settings.GATEWAY, (settings.GATEWAY,))
    )
    procs: list[subprocess.Popen] = []
    signals: list[int] = []

    def forward(sig, frame):
        signals.append(sig)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(sig)

    # Set before the children start, so that a signal never finds this process without them knowing of it.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    try:
        for index, control in enumerate(controls):
            if signals:  # a stop came while the earlier children were starting: start no more
                break
            procs.append(spawn("gateway", "--gateway-index", str(index), "--control", control, env=env))
            if signals:  # it came while this one was starting, before forward knew of it
                procs[-1].send_signal(signals[-1])
        if not signals:
            log.info(
                "%d gateway processes on http://%s:%d; workers register at %s (give each worker --gateway %s)",
                len(procs),
                config.host,
                config.port,
                ", ".join(controls),
                ",".join(controls),
            )
        failed = watch(procs, signals)
    finally:
        stop_all(procs)  # those still running after an error here; after a normal end, none is
    if failed:
        return 1
    ended_well = ENDED_BY_A_STOP if signals else (0,)
    return 0 if all(proc.returncode in ended_well for proc in procs) else 1


def watch(procs: list[subprocess.Popen], signals: list[int]) -> bool:
    """Wait until every child has exited; True when one exited of its own accord (no signal had come), and the
    others were stopped for it."""
    failed = False
    while any(proc.poll() is None for proc in procs):
        if not signals and not failed:
            exited = next((i for i, proc in enumerate(procs) if proc.poll() is not None), None)
            if exited is not None:
                log.error(
                    "gateway process %d exited (status %d); stopping the others", exited, procs[exited].returncode
                )
                failed = True
                for proc in procs:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
    return failed
