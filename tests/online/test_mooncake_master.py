"""scripts.online.master: a real mooncake_master (and the mooncake_client lending it memory)
that a real Mooncake store client reaches with the variables env() gives; a client pointed
where nothing listens fails its setup, a master that cannot start says why, and the store
listens on loopback but where Mooncake gives no choice."""

import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterable, List, Set, Tuple, Union

import pytest
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

from scripts.online.master import MasterFailed, MooncakeMaster, accepts_connections, free_ports
from scripts.paths import REPO_ROOT

CLIENT_SEGMENT = 16 << 20  # the memory a test's client lends the store
CLIENT_BUFFER = 16 << 20
LENT_SEGMENT = 32 << 20  # the memory the store's own mooncake_client lends
PAYLOADS = {"a": b"hidden", "b": bytes(range(256)) * 64, "c": b"\0" * 4096}


def connect(env, segment_size=CLIENT_SEGMENT):
    """A store client set up as the sink's is, from the MOONCAKE_* variables; (status, client)."""
    store = MooncakeDistributedStore()
    status = store.setup(env["MOONCAKE_LOCAL_HOSTNAME"], env["MOONCAKE_METADATA_SERVER"], segment_size,
                         CLIENT_BUFFER, env["MOONCAKE_PROTOCOL"], "", env["MOONCAKE_MASTER_SERVER_ADDR"])
    return status, store


def round_trip(store):
    """Put each payload hard-pinned, then read it back: {key: bytes read}."""
    config = ReplicateConfig()
    config.replica_num = 1
    config.with_hard_pin = True
    assert {key: store.put(key, value, config) for key, value in PAYLOADS.items()} == dict.fromkeys(PAYLOADS, 0)
    return {key: store.get(key) for key in PAYLOADS}


def test_a_client_puts_and_gets_through_the_master(tmp_path):
    with MooncakeMaster(tmp_path / "master.log") as master:
        status, store = connect(master.env())
        assert status == 0
        assert round_trip(store) == PAYLOADS
        store.close()
    assert "Master service started" in (tmp_path / "master.log").read_text()
    assert not accepts_connections(master.rpc_port)


def test_the_stores_own_client_lends_it_memory(tmp_path):
    """With segment_size the store holds objects that clients lending no memory put (as the
    sink's writers lend none), and they outlive the client that put them."""
    with MooncakeMaster(tmp_path / "master.log", segment_size=LENT_SEGMENT) as master:
        assert master.capacity() == LENT_SEGMENT
        status, writer = connect(master.env(), segment_size=0)
        assert status == 0
        round_trip(writer)
        writer.close()
        status, reader = connect(master.env(), segment_size=0)
        assert status == 0
        assert {key: reader.get(key) for key in PAYLOADS} == PAYLOADS
        reader.close()
    assert (tmp_path / "master.client.log").exists()


def test_a_client_pointed_where_nothing_listens_fails_setup(tmp_path, monkeypatch):
    """The negative control of the tests above: setup returns -1 (it raises nothing). Each
    attempt takes about 4.4 s; Mooncake makes 20 (90 s) unless told otherwise."""
    monkeypatch.setenv("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    (nowhere,) = free_ports(1)
    with MooncakeMaster(tmp_path / "master.log") as master:
        status, _ = connect({**master.env(), "MOONCAKE_MASTER_SERVER_ADDR": f"127.0.0.1:{nowhere}"})
    assert status == -1


def test_a_master_that_exits_fails_with_its_log(tmp_path):
    master = MooncakeMaster(tmp_path / "master.log")
    master.master_args.append("--no_such_flag=1")
    with pytest.raises(MasterFailed, match="(?s)mooncake_master exited with code.*no_such_flag"):
        master.start()


def test_a_missing_master_names_its_package(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MasterFailed, match="install mooncake-transfer-engine-non-cuda"):
        MooncakeMaster(tmp_path / "master.log").start()


def test_the_command_prints_the_exports_and_stops_on_sigterm(tmp_path):
    command = subprocess.Popen(
        [sys.executable, "-m", "scripts.online.master", "--segment-size", str(LENT_SEGMENT),
         "--log", str(tmp_path / "master.log")],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        exports = {}
        for line in command.stdout:
            if line.startswith("# log:"):
                break
            name, value = line.removeprefix("export ").rstrip("\n").split("=", 1)
            exports[name] = value
        assert set(exports) == {"MOONCAKE_MASTER_SERVER_ADDR", "MOONCAKE_METADATA_SERVER", "MOONCAKE_PROTOCOL",
                                "MOONCAKE_LOCAL_HOSTNAME"}, command.stderr.read() if command.poll() is not None else ""
        status, store = connect(exports, segment_size=0)
        assert status == 0
        assert round_trip(store) == PAYLOADS
        store.close()
        command.send_signal(signal.SIGTERM)
        assert command.wait(60) == 128 + signal.SIGTERM
        assert not accepts_connections(int(exports["MOONCAKE_MASTER_SERVER_ADDR"].rsplit(":", 1)[1]))
    finally:
        command.kill()
        command.wait()


LISTEN_STATE = "0A"  # TCP_LISTEN in /proc/net/tcp
Address = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]


def socket_inodes(pid: int) -> Set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def proc_net_address(field: str) -> Tuple[Address, int]:
    """/proc/net/tcp{,6}'s `local_address`: the address as 32-bit words in host (little-endian)
    order, in hex, then the port."""
    address, port = field.split(":")
    packed = b"".join(int(address[i:i + 8], 16).to_bytes(4, "little") for i in range(0, len(address), 8))
    return ipaddress.ip_address(packed), int(port, 16)


def listening(pids: Iterable[int]) -> List[Tuple[Address, int]]:
    """Every (address, port) a TCP socket of these processes listens on."""
    inodes = set().union(*(socket_inodes(pid) for pid in pids))
    found = []
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == LISTEN_STATE and fields[9] in inodes:
                found.append(proc_net_address(fields[1]))
    return found


def beyond_loopback(sockets) -> Set[int]:
    """The ports of those sockets that listen on an address other hosts can reach."""
    def loopback(address):
        mapped = getattr(address, "ipv4_mapped", None)
        return address.is_loopback or (mapped is not None and mapped.is_loopback)
    return {port for address, port in sockets if not loopback(address)}


def test_the_listening_check_sees_a_socket_on_every_address():
    """The control of the test below: a listener on 0.0.0.0 (and one on ::) is caught, one on
    127.0.0.1 is not."""
    with socket.socket() as everywhere, socket.socket() as local, socket.socket(socket.AF_INET6) as everywhere6:
        for held, address in ((everywhere, "0.0.0.0"), (local, "127.0.0.1"), (everywhere6, "::")):
            held.bind((address, 0))
            held.listen()
        ports = {name: held.getsockname()[1] for name, held in
                 (("everywhere", everywhere), ("local", local), ("everywhere6", everywhere6))}
        mine = listening([os.getpid()])
    assert {port for _, port in mine} >= set(ports.values())
    assert beyond_loopback(mine) >= {ports["everywhere"], ports["everywhere6"]}
    assert ports["local"] not in beyond_loopback(mine)


def test_the_store_listens_on_loopback_but_for_the_transfer_engine(tmp_path):
    """The master, the metadata server and the memory client listen on 127.0.0.1, but for the
    two listeners Mooncake's transfer engine opens in the client on every address whatever it
    is told (its RPC/handshake port and its TCP data port, both named in the client's log): the
    README says what they expose."""
    with MooncakeMaster(tmp_path / "master.log", segment_size=LENT_SEGMENT) as master:
        processes = {name: process.pid for name, process in
                     (("master", master.master), ("metadata", master.metadata_server), ("client", master.client))}
        sockets = {name: listening([pid]) for name, pid in processes.items()}
    assert all(sockets.values()), sockets  # each listens somewhere: the check looks at the right processes
    assert beyond_loopback(sockets["master"]) == set()
    assert beyond_loopback(sockets["metadata"]) == set()
    client_log = (tmp_path / "master.client.log").read_text()
    transfer_engine = {int(port) for port in re.findall(r"Transfer Engine RPC using .*listening on \S+:(\d+)", client_log)
                       + re.findall(r"TcpTransport: listen on port (\d+)", client_log)}
    assert len(transfer_engine) == 2, client_log
    assert beyond_loopback(sockets["client"]) == transfer_engine
