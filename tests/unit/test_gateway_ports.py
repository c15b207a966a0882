"""--gateways N: each gateway process's control port (the first's and those after it), the checks that every port
is free before any process starts, and the HTTP sockets that share one port, on real sockets."""

import contextlib
import socket

import pytest

from kvferry.common.bind_check import listen_tcp
from kvferry.common.errors import ConfigError
from kvferry.common.gateway_ports import check_gateway_ports, control_addresses
from kvferry.services.launcher import free_port


def test_one_gateway_keeps_its_control_address_whatever_it_is():
    for address in ("tcp://127.0.0.1:5557", "tcp://*:0", "ipc:///tmp/kvferry-control", "tcp://eth0:5557"):
        assert control_addresses(address, 1) == [address]


def test_each_gateway_takes_the_next_control_port():
    assert control_addresses("tcp://127.0.0.1:5557", 3) == [
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
        "tcp://127.0.0.1:5559",
    ]
    assert control_addresses("tcp://*:7000", 2) == ["tcp://*:7000", "tcp://*:7001"]
    assert control_addresses("tcp://[::1]:7000", 2) == ["tcp://[::1]:7000", "tcp://[::1]:7001"]
    assert control_addresses("tcp://127.0.0.1:65534", 2)[-1] == "tcp://127.0.0.1:65535"


@pytest.mark.parametrize(
    "address,num,words",
    [
        ("ipc:///tmp/kvferry-control", 2, "as tcp://HOST:PORT with a fixed port"),
        ("tcp://127.0.0.1:0", 2, "as tcp://HOST:PORT with a fixed port"),
        ("tcp://127.0.0.1", 2, "as tcp://HOST:PORT with a fixed port"),
        ("tcp://127.0.0.1:65535", 2, "the control ports 65535 to 65536, beyond 65535"),
    ],
)
def test_several_gateways_need_a_tcp_control_port_with_room_after_it(address, num, words):
    with pytest.raises(ConfigError) as refused:
        control_addresses(address, num)
    message = str(refused.value)
    assert words in message and "--gateways (KVFERRY_GATEWAYS)" in message and "--control (KVFERRY_CONTROL)" in message
    with pytest.raises(ConfigError, match="--control-port"):  # serve's words for it
        control_addresses(address, num, "--control-port (KVFERRY_CONTROL_PORT)")


def test_a_control_port_past_65535_is_refused_as_such_not_for_the_ports_after_it():
    with pytest.raises(ConfigError) as refused:
        control_addresses("tcp://127.0.0.1:70000", 2)
    assert (
        str(refused.value)
        == "--control (KVFERRY_CONTROL): the port of 'tcp://127.0.0.1:70000' is past 65535, the last there is"
    )


@contextlib.contextmanager
def listening(port: int, reuse_port: bool = False):
    sock = listen_tcp("127.0.0.1", port, "--port", reuse_port=reuse_port)
    try:
        yield sock
    finally:
        sock.close()


def test_free_ports_pass_and_a_taken_control_port_is_refused_naming_its_setting():
    http, control = free_port(), free_port(count=3)
    controls = control_addresses(f"tcp://127.0.0.1:{control}", 3)
    check_gateway_ports("127.0.0.1", http, controls)
    with listening(control + 2):
        with pytest.raises(ConfigError) as refused:
            check_gateway_ports("127.0.0.1", http, controls)
        assert f"--control (KVFERRY_CONTROL): cannot listen on 127.0.0.1:{control + 2}" in str(refused.value)
        with pytest.raises(ConfigError, match="--control-port"):
            check_gateway_ports("127.0.0.1", http, controls, "--control-port (KVFERRY_CONTROL_PORT)")


def test_a_wildcard_control_host_is_checked_on_every_interface():
    control = free_port()
    with listening(control), pytest.raises(ConfigError, match=f"0.0.0.0:{control}"):
        check_gateway_ports("127.0.0.1", free_port(), [f"tcp://*:{control}"])


def test_several_gateways_refuse_a_taken_http_port_even_one_shared_with_so_reuseport():
    http, control = free_port(), free_port(count=2)
    controls = control_addresses(f"tcp://127.0.0.1:{control}", 2)
    for reuse_port in (False, True):  # another group's socket would let ours join it without the check
        with listening(http, reuse_port), pytest.raises(ConfigError, match=f"--port .*127.0.0.1:{http}"):
            check_gateway_ports("127.0.0.1", http, controls)
    with listening(http):  # one gateway's own bind says so, as it always did
        check_gateway_ports("127.0.0.1", http, controls[:1])
    with pytest.raises(ConfigError, match="needs a fixed --port"):
        check_gateway_ports("127.0.0.1", 0, controls)


def test_sockets_with_so_reuseport_share_the_port_and_one_without_it_cannot_join():
    port = free_port()
    with listening(port, reuse_port=True), listening(port, reuse_port=True):
        with pytest.raises(ConfigError, match="Address already in use"):
            listen_tcp("127.0.0.1", port, "--port")
    with listening(port), pytest.raises(ConfigError, match="Address already in use"):
        listen_tcp("127.0.0.1", port, "--port", reuse_port=True)


def test_free_port_hands_out_runs_of_free_ports_never_twice():
    firsts = [free_port(count=4) for _ in range(10)]
    taken = [port for first in firsts for port in range(first, first + 4)]
    assert len(set(taken)) == len(taken)
    for port in taken:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_an_http_port_among_the_control_ports_is_refused_naming_both_settings():
    http = free_port(count=2)
    controls = control_addresses(f"tcp://127.0.0.1:{http - 1}", 2)  # serve --gateways 2 --port P --control-port P-1
    with pytest.raises(ConfigError) as refused:
        check_gateway_ports("127.0.0.1", http, controls, "--control-port (KVFERRY_CONTROL_PORT)")
    assert str(refused.value) == (
        f"--port (KVFERRY_PORT) {http} is also a control port (tcp://127.0.0.1:{http}, from --control-port "
        "(KVFERRY_CONTROL_PORT)): give one of them another port"
    )
    with pytest.raises(ConfigError, match=f"{http} is also a control port .* from --control "):  # one gateway too
        check_gateway_ports("0.0.0.0", http, [f"tcp://*:{http}"])
