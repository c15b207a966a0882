"""Where the processes of --gateways N listen. They share the HTTP port: each binds its own socket with SO_REUSEPORT,
and the kernel hands each new connection to one of them. Each has a control port of its own, the first gateway's
and the N-1 after it (tcp://HOST:5557 -> :5557, :5558, ...), and every worker is given all of them, so that it
registers with each. Checked before any process starts: a taken port is refused at once, naming the setting.
"""

from kvferry.common import settings
from kvferry.common.bind_check import check_port_free
from kvferry.common.errors import ConfigError
from kvferry.common.peer_address import MAX_PORT, TCP


def control_addresses(first: str, num_gateways: int, setting: str = "") -> list[str]:
    """The control address of each of num_gateways gateway processes: first's port and those after it. One gateway
    keeps first as it is (any ZeroMQ address). setting: how errors name where first came from (default --control)."""
    setting = setting or settings.label("control")
    if num_gateways == 1:
        return [first]
    match = TCP.fullmatch(first)
    if match is None or int(match["port"]) == 0:
        raise ConfigError(
            f"{settings.label('gateways')} {num_gateways} needs {setting} as tcp://HOST:PORT with a "
            f"fixed port (the gateway processes take PORT, PORT+1, ...), got {first!r}"
        )
    host, port = match["host"], int(match["port"])
    if port > MAX_PORT:
        raise ConfigError(f"{setting}: the port of {first!r} is past {MAX_PORT}, the last there is")
    if port + num_gateways - 1 > MAX_PORT:
        raise ConfigError(
            f"{settings.label('gateways')} {num_gateways} takes the control ports {port} to {port + num_gateways - 1}, "
            f"beyond {MAX_PORT}: give {setting} a lower port"
        )
    return [f"tcp://{host}:{port + i}" for i in range(num_gateways)]


def check_gateway_ports(http_host: str, http_port: int, controls: list[str], control_setting: str = "") -> None:
    """A ConfigError when the HTTP port is one of the control ports, or when it or a control port is taken: before
    the gateway processes start, because one process that fails to bind would leave the others serving a part of the
    group. The HTTP port is checked for being taken only for several processes: their SO_REUSEPORT sockets would
    otherwise join another group of this user's on that port; one gateway's own bind refuses a taken port plainly.
    control_setting: as control_addresses' setting."""
    control_setting = control_setting or settings.label("control")
    for address in controls:
        # Refused whatever the hosts, which mostly overlap (0.0.0.0 takes the port on every interface): else a
        # gateway process binds one of the two and fails on the other, once the group and its workers have started.
        if (match := TCP.fullmatch(address)) and int(match["port"]) == http_port != 0:
            raise ConfigError(
                f"{settings.label('port')} {http_port} is also a control port ({address}, from {control_setting}): "
                "give one of them another port"
            )
    if len(controls) > 1:
        if http_port == 0:
            raise ConfigError(
                f"{settings.label('gateways')} {len(controls)} needs a fixed {settings.label('port')}: with 0 each "
                "gateway process would listen on a port of its own"
            )
        check_port_free(http_host, http_port, settings.label("port"))
    for address in controls:
        match = TCP.fullmatch(address)
        if match is None or int(match["port"]) == 0:
            continue  # ipc://, or a port the system picks: nothing to collide with
        host = match["host"].strip("[]")
        check_port_free("0.0.0.0" if host == "*" else host, int(match["port"]), control_setting)
