"""`kvferry serve`'s own settings (ServeConfig): how it starts its gateway and two workers. Each declared once as a
field; serve takes the gateway's, the engine's and the workers' settings beside them, and hands them on."""

from kvferry.common.peer_address import MAX_PORT
from kvferry.common.setting import SERVE, setting, settings_class


@settings_class((SERVE,), "gateway")
class ServeConfig:
    control_port: int = setting(
        5557, "the port on 127.0.0.1 where serve's workers register at its gateway", min=1, max=MAX_PORT
    )
    # On a small machine both workers take every core and the decode worker runs at a lower priority: a prompt's
    # prefill has the cores while it lasts (its GEMMs are the most efficient work, and its requests join the decode
    # batch sooner). That beat splitting the cores (docs/benchmarks.md), at the price of decode's pace during a burst
    # of prompts; decode_nice 0 shares them evenly.
    prefill_threads: int = setting(2, "torch threads of serve's prefill worker", min=1)
    decode_threads: int = setting(2, "torch threads of serve's decode worker", min=1)
    decode_nice: int = setting(
        10, "niceness of serve's decode worker, as nice(1)'s: how far it yields the cores to prefill", min=0, max=19
    )
