"""How a process joins a Mooncake store: the MOONCAKE_* variables SpecForge's users already
set, read and checked in one place. The dump's config reads them for the servers' writers;
a trainer's HiddenStatesStream reads the same names (loaded by its path: this module imports
nothing beyond the standard library).
"""

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

MOONCAKE_PROTOCOLS = ("tcp", "rdma")
SIZE_UNITS = {"": 1, "b": 1, "kb": 1 << 10, "kib": 1 << 10, "mb": 1 << 20, "mib": 1 << 20,
              "gb": 1 << 30, "gib": 1 << 30, "tb": 1 << 40, "tib": 1 << 40}
HOST_PORT = re.compile(r"^[A-Za-z0-9_.\-]+:[0-9]{1,5}$")


@dataclass(frozen=True)
class MooncakeSettings:
    """How the writer connects to a Mooncake store, from the MOONCAKE_* variables that
    SpecForge's users already set (read here, once: they are Mooncake's names, not SGLang's,
    so environ.py does not declare them). The defaults are SpecForge's, but for the global
    segment: 0, the server lends the store no memory, so a server that dies takes no
    published sample with it (the store's memory comes from its own mooncake_client)."""

    master_server_addr: str = "localhost:50051"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    global_segment_size: int = 0
    local_buffer_size: int = 1 << 30
    rdma_devices: str = ""
    local_hostname: str = "localhost"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ,
                 defaults: Optional["MooncakeSettings"] = None) -> "MooncakeSettings":
        """The settings `environ` gives, each checked; unset ones from `defaults` (these)."""
        defaults = defaults or cls()

        def get(name: str, default) -> str:
            value = environ.get(name)
            return str(default) if value is None else value.strip()

        master = get("MOONCAKE_MASTER_SERVER_ADDR", defaults.master_server_addr)
        if not HOST_PORT.match(master) or not 0 < int(master.rsplit(":", 1)[1]) < 65536:
            raise ValueError(
                f"MOONCAKE_MASTER_SERVER_ADDR={master!r}: give the master's host:port "
                f"(e.g. 10.0.0.1:50051)."
            )
        metadata = get("MOONCAKE_METADATA_SERVER", defaults.metadata_server)
        if metadata != "P2PHANDSHAKE" and not re.match(r"^(http|etcd|redis)://\S+$", metadata):
            raise ValueError(
                f"MOONCAKE_METADATA_SERVER={metadata!r}: give P2PHANDSHAKE or a URL "
                f"(http://host:port/metadata, etcd://host:port, redis://host:port)."
            )
        protocol = get("MOONCAKE_PROTOCOL", defaults.protocol).lower()
        if protocol not in MOONCAKE_PROTOCOLS:
            raise ValueError(f"MOONCAKE_PROTOCOL={protocol!r}: use one of {', '.join(MOONCAKE_PROTOCOLS)}.")
        hostname = get("MOONCAKE_LOCAL_HOSTNAME", defaults.local_hostname)
        if not hostname or any(c.isspace() for c in hostname):
            raise ValueError(f"MOONCAKE_LOCAL_HOSTNAME={hostname!r}: give this host's name or address.")
        return cls(
            master_server_addr=master,
            metadata_server=metadata,
            protocol=protocol,
            global_segment_size=parse_size(
                "MOONCAKE_GLOBAL_SEGMENT_SIZE", get("MOONCAKE_GLOBAL_SEGMENT_SIZE", defaults.global_segment_size)
            ),
            local_buffer_size=parse_size(
                "MOONCAKE_LOCAL_BUFFER_SIZE", get("MOONCAKE_LOCAL_BUFFER_SIZE", defaults.local_buffer_size)
            ),
            rdma_devices=get("MOONCAKE_RDMA_DEVICES", defaults.rdma_devices),
            local_hostname=hostname,
        )


def parse_size(name: str, value: str) -> int:
    """Bytes, as an integer or with a unit (KB, MB, GB, TB; binary, as Mooncake takes them)."""
    match = re.match(r"^([0-9]+)\s*([A-Za-z]*)$", value.strip())
    if not match or match.group(2).lower() not in SIZE_UNITS:
        raise ValueError(f"{name}={value!r}: give a size in bytes, e.g. 1073741824 or 1GB.")
    return int(match.group(1)) * SIZE_UNITS[match.group(2).lower()]
