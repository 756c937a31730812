"""The Mooncake sink's writer process: the file sink's writer process (files.WriterProcess),
whose last step puts each sample in a Mooncake store instead of writing a file.

Run as a script by store_sink.StoreDumpWriter, with the server's Python and site-packages
(torch, mooncake, hs-connectors) but not SGLang: its siblings files.py and store_layouts.py
are imported from this file's folder. Per sample, on a writer thread, the objects are put
(hard-pinned: the store never evicts them; the trainer removes them once trained on); in
the sample's turn its manifest line is appended and, in SpecForge's layout, its SampleRef
to the control directory's channel. So a manifest line or a ref always names a complete
sample, and a sample is never half-visible: an object is visible once its put returns, and
a sample's objects are named only after every put has. The line and the ref are appended
under the channel's lock; a writer killed between the two leaves a listed sample that no
rerun dumps again and SpecForge's trainer would never see, so a writer starting on the
manifest publishes the refs its lines lack (rebuilt from them) and cuts a torn last ref.

Every object's checksum (files.checksum, of the bytes put) is in the sample's manifest line:
in SpecForge's layout beside each object's key; in hs-connectors' the packed object's as the
line's "checksum" and in its transfer manifest's metadata, and each tensor's in the transfer
manifest's spec of it, which is what a reader that unpacks the object checks.

A full store (-200, NO_AVAILABLE_HANDLE) is waited out under `block`, backing off, which
fills the scheduler's queue as a slow disk does; under `drop` the sample is dropped and
counted. Any other failure removes what the sample had put and, in hs-connectors' layout,
puts its error marker; SpecForge's layout has no per-sample marker (no ref is published).
"""

import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
import warnings
from typing import Dict, List, Optional

import torch

# The rows are mapped read-only; the puts only read them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import files  # noqa: E402
import store_layouts  # noqa: E402

# Mooncake's status codes (mooncake-store/include/types.h).
NO_AVAILABLE_HANDLE = -200  # the store is full
OBJECT_NOT_FOUND = -704
# Backing off while the store is full: the first wait, doubled up to the last.
STORE_FULL_FIRST_WAIT_S = 0.005
STORE_FULL_LONGEST_WAIT_S = 0.5
STAGING_GRANULE = 64 << 20
REACH_TIMEOUT_S = 10.0


class StoreFull(Exception):
    """The store had no room for an object (-200)."""


class PutFailed(Exception):
    def __init__(self, key: str, status):
        super().__init__(f"Mooncake put of {key!r} failed with status {status}")


class PinnedPuts:
    """The store as hs-connectors' MooncakeHiddenStatesStore calls it, but every put
    hard-pinned (it passes no ReplicateConfig, and unpinned objects are evicted silently
    when the store fills: TorchSpec lost samples that way) and a full store raised as
    StoreFull, so that its own put_sample and put_error write the packed layout."""

    def __init__(self, store, config):
        self._store = store
        self._config = config
        self.checksums: Dict[str, str] = {}  # of each packed object put, by key, until taken

    def put_from(self, key: str, pointer: int, size: int) -> int:
        status = checked(key, self._store.put_from(key, pointer, size, self._config))
        self.checksums[key] = files.checksum([memoryview((ctypes.c_char * size).from_address(pointer)).cast("B")])
        return status

    def put(self, key: str, value: bytes) -> int:
        return checked(key, self._store.put(key, value, self._config))

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes, without a copy."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


def int64_bytes(values: List[int]) -> memoryview:
    return memoryview(torch.tensor(values, dtype=torch.int64).numpy()).cast("B")


def checked(key: str, status) -> int:
    if status == NO_AVAILABLE_HANDLE:
        raise StoreFull(key)
    if not isinstance(status, int) or status < 0:
        raise PutFailed(key, status)
    return status


def reachable(address: str) -> Optional[str]:
    """Why nothing answers TCP at host:port (None: something does)."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as e:
        return f"nothing answers at {address} ({e})"
    return None


def connect(settings: dict):
    """A Mooncake client set up with the sink's settings (config.MooncakeSettings), and the
    ReplicateConfig of every put; ValueError saying what failed."""
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    # Mooncake's setup retries an absent master for minutes; a refused connection says it
    # at once.
    metadata = settings["metadata_server"]
    addresses = [("MOONCAKE_MASTER_SERVER_ADDR", settings["master_server_addr"])]
    if metadata.startswith("http://"):
        addresses.append(("MOONCAKE_METADATA_SERVER", metadata[len("http://"):].split("/", 1)[0]))
    for name, address in addresses:
        problem = reachable(address)
        if problem:
            raise ValueError(f"hidden states dump: cannot connect to the Mooncake store ({name}={address}): {problem}")
    store = MooncakeDistributedStore()
    try:
        status = store.setup(
            settings["local_hostname"],
            settings["metadata_server"],
            settings["global_segment_size"],
            settings["local_buffer_size"],
            settings["protocol"],
            settings["rdma_devices"],
            settings["master_server_addr"],
        )
    except Exception as e:
        status = repr(e)
    if status != 0:
        raise ValueError(
            f"hidden states dump: cannot connect to the Mooncake store "
            f"(MOONCAKE_MASTER_SERVER_ADDR={settings['master_server_addr']}, "
            f"MOONCAKE_METADATA_SERVER={settings['metadata_server']}, "
            f"MOONCAKE_PROTOCOL={settings['protocol']}): setup returned {status}"
        )
    config = ReplicateConfig()
    config.replica_num = 1
    config.with_hard_pin = True
    if settings["global_segment_size"]:
        # A writer that lends the store memory puts its samples there first: Mooncake copies
        # them in this host's memory (its local memcpy), where a put to another segment is
        # a transfer, and trainers read them from here. They go with this process if it dies.
        config.preferred_segment = store.get_hostname()
    return store, config


class StoreWriterProcess(files.WriterProcess):
    """Puts each sample's objects on writer threads, side by side, and publishes their
    manifest lines (and refs) in submission order."""

    def __init__(self, sock: socket.socket, dump_dir: str, manifest_name: str, threads: int,
                 settings: dict, store, put_config):
        super().__init__(sock, dump_dir, manifest_name, threads)
        self.settings = settings
        self.layout = settings["layout"]
        self.store_id = settings["store_id"]
        self.on_full_queue = settings["on_full_queue"]
        self.store = store
        self.put_config = put_config
        self.addresses: Dict[int, int] = {}  # segment id: the address it is mapped at
        self.staging = threading.local()
        if self.layout == "hs-connectors":
            from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

            self.packed = MooncakeHiddenStatesStore(MooncakeStoreConfig())
            # Its own put_sample and put_error, through this client, hard-pinned.
            self.packed._store = PinnedPuts(store, put_config)

    def run(self) -> None:
        super().run()
        self.store.close()  # after the last put: the queue is drained

    def view(self, part) -> memoryview:
        segment_id = part[0]
        if segment_id not in self.addresses:
            mapped = self.segments[segment_id]
            address = torch.frombuffer(mapped, dtype=torch.uint8).data_ptr() if len(mapped) else 0
            # RDMA reads the rows straight from the shared segment (TCP ignores this).
            self.store.register_buffer(address, len(mapped))
            self.addresses[segment_id] = address
        return super().view(part)

    def take(self, message: tuple):
        """("job", sequence, None, tensors, entry, loss mask runs): tensors as (name, dtype
        name, shape, [(segment id, offset, length), ...]) in the dump's file order."""
        _, sequence, _, tensors, entry, loss_mask_runs = message
        rows = {
            name: (dtype, tuple(shape), [self.view(part) for part in parts])
            for name, dtype, shape, parts in tensors
        }
        return sequence, rows, json.loads(entry), loss_mask_runs

    def write(self, job) -> tuple:
        """Put one sample (on a writer thread): its manifest line, its ref (None in
        hs-connectors' layout) and its bytes. Waits while the store is full, under
        `block`; raises StoreFull under `drop`."""
        sequence, rows, entry, loss_mask_runs = job
        sample = store_layouts.sample_id(
            self.settings["writer_id"], self.settings["dp_rank"], self.settings["run_id"], sequence
        )
        num_tokens = rows["token_ids"][1][0]
        loss_mask = store_layouts.loss_mask_values(loss_mask_runs, num_tokens)
        put = self.put_specforge if self.layout == "specforge" else self.put_packed
        waited = False
        delay = STORE_FULL_FIRST_WAIT_S
        while True:
            try:
                return put(sample, rows, dict(entry), loss_mask)
            except StoreFull:
                if self.on_full_queue == "drop":
                    raise
                if not waited:
                    self.answer(("store-full", sequence))
                time.sleep(delay)
                waited = True
                delay = min(2 * delay, STORE_FULL_LONGEST_WAIT_S)

    def publish(self, written) -> int:
        """The manifest line and, in SpecForge's layout, the ref, both under the channel's
        lock: a writer starting on the manifest (publish_missing_refs) never sees a live
        writer's line without its ref."""
        line, ref, size = written
        manifest = os.path.join(self.dump_dir, self.manifest_name)
        if ref is None:
            files.append_line(manifest, line)
            return size
        with files.locked_lines(os.path.join(self.dump_dir, store_layouts.REF_CHANNEL)) as channel:
            files.append_line(manifest, line)
            channel.append(ref)
        return size

    def publish_missing_refs(self) -> int:
        """Publish the refs a writer killed between a sample's manifest line and its ref
        left out (SpecForge's trainer, reading the channel, would never see those samples),
        rebuilt from their lines; first cut a torn last line of the channel. Returns how
        many were published."""
        with files.locked_lines(os.path.join(self.dump_dir, store_layouts.REF_CHANNEL)) as channel:
            published = {ref.get("sample_id") for ref in channel.lines()}
            missing = []
            for line in files.read_lines(os.path.join(self.dump_dir, self.manifest_name)):
                if line.get("layout") != "specforge" or line.get("sample_id") in published:
                    continue
                run_id = store_layouts.run_of_sample(
                    line["sample_id"], self.settings["writer_id"], self.settings["dp_rank"]
                )
                if run_id is not None:
                    missing.append(self.ref_of(line, run_id))
            for ref in missing:
                channel.append(ref)
        return len(missing)

    def not_written(self, sequence: int, error: Exception) -> None:
        if isinstance(error, StoreFull):
            self._failed(sequence, "the Mooncake store is full", kind="dropped")
        else:
            super().not_written(sequence, error)

    def put_specforge(self, sample: str, rows, entry: dict, loss_mask: List[int]):
        """One raw object per tensor; a failed put removes the sample's other objects."""
        tensors = {name: (dtype, shape) for name, (dtype, shape, _) in rows.items()}
        objects = store_layouts.specforge_objects(self.store_id, sample, tensors)
        # (parts, whether they lie in shared memory the store has registered)
        sources = {
            "hidden_state": (rows["hidden_states"][2], True),
            "target": (rows["last_hidden_state"][2], True),
            "input_ids": (rows["token_ids"][2], True),
            "loss_mask": ([int64_bytes(loss_mask)], False),
            "attention_mask": ([int64_bytes([1] * len(loss_mask))], False),
        }
        keys = [spec["key"] for spec in objects.values()]
        for name, spec in objects.items():
            spec["checksum"] = files.checksum(sources[name][0])
        pointers, sizes = self.contiguous([sources[name] for name in objects])
        statuses = self.store.batch_put_from(keys, pointers, sizes, self.put_config)
        failed = [(key, status) for key, status in zip(keys, statuses) if status != 0]
        if failed:
            self.remove([key for key, status in zip(keys, statuses) if status == 0])
            if any(status == NO_AVAILABLE_HANDLE for _, status in failed):
                raise StoreFull(failed[0][0])
            raise PutFailed(*failed[0])
        size = sum(sizes)
        extra = dict(encoding=entry.pop("encoding"), model_dtype=entry.pop("model_dtype", None))
        line = store_layouts.store_manifest_line(entry, self.layout, sample, size, objects=objects, **extra)
        return line, self.ref_of(json.loads(line), self.settings["run_id"]), size

    def ref_of(self, line: dict, run_id: str) -> str:
        ref = store_layouts.specforge_ref_of_line(self.store_id, line, self.settings["writer_id"], run_id)
        return json.dumps(ref, separators=(",", ":"))

    def put_packed(self, sample: str, rows, entry: dict, loss_mask: List[int]):
        """One packed object, by hs-connectors' own packed_layout and put_sample; a failure
        other than a full store puts the sample's error marker."""
        dump_tensors = {name: (dtype, shape) for name, (dtype, shape, _) in rows.items()}
        manifest = store_layouts.packed_manifest(self.store_id, sample, dump_tensors)
        total = manifest["metadata"]["total_aligned_bytes"]
        values = {
            name: self.tensor(rows[name]) for name in manifest["tensors"] if name != "loss_mask"
        }
        values["loss_mask"] = torch.tensor(loss_mask, dtype=torch.int64)
        for name, value in values.items():
            manifest["tensors"][name]["checksum"] = files.checksum([tensor_bytes(value)])
        try:
            self.packed.put_sample(manifest, values)
        except StoreFull:
            raise
        except Exception as e:
            try:
                self.packed.put_error(manifest, repr(e))
            except Exception:
                pass  # the sample is still not published: no manifest line names it
            raise
        checksum = self.packed._store.checksums.pop(manifest["handle"])
        manifest["metadata"]["checksum"] = checksum
        extra = dict(encoding=entry.pop("encoding"), model_dtype=entry.pop("model_dtype", None))
        line = store_layouts.store_manifest_line(
            entry, self.layout, sample, total, transfer_manifest=manifest, checksum=checksum, **extra
        )
        return line, None, total

    def tensor(self, row) -> torch.Tensor:
        """A dump tensor as torch sees it: its chunks' bytes, viewed (or joined) and shaped."""
        dtype, shape, parts = row
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        flat = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        return flat.view(getattr(torch, dtype)).view(shape)

    def contiguous(self, sources):
        """Each object's address and size: one part of a shared segment is put from where
        it lies (no copy); the rest is copied into this thread's staging buffer, which the
        store has registered."""
        pointers, sizes, copies = [], [], []
        for parts, registered in sources:
            size = sum(len(part) for part in parts)
            sizes.append(size)
            if registered and len(parts) == 1:
                pointers.append(torch.frombuffer(parts[0], dtype=torch.uint8).data_ptr() if size else 0)
            else:
                pointers.append(None)
                copies.append((len(pointers) - 1, parts, size))
        staging = self.staging_buffer(sum(size for _, _, size in copies))
        offset = 0
        for index, parts, size in copies:
            pointers[index] = staging.data_ptr() + offset
            for part in parts:
                staging[offset : offset + len(part)] = torch.frombuffer(part, dtype=torch.uint8)
                offset += len(part)
        return pointers, sizes

    def staging_buffer(self, size: int) -> torch.Tensor:
        buffer: Optional[torch.Tensor] = getattr(self.staging, "buffer", None)
        if buffer is None or buffer.numel() < size:
            if buffer is not None:
                self.store.unregister_buffer(buffer.data_ptr())
            capacity = -(-max(size, 1) // STAGING_GRANULE) * STAGING_GRANULE
            buffer = torch.empty(capacity, dtype=torch.uint8)
            self.store.register_buffer(buffer.data_ptr(), capacity)
            self.staging.buffer = buffer
        return buffer

    def remove(self, keys: List[str]) -> None:
        """Remove objects this writer put, with force: a reader's lease does not keep
        them (Mooncake returns -706 for a plain remove then)."""
        for key in keys:
            status = self.store.remove(key, force=True)
            if status not in (0, OBJECT_NOT_FOUND):
                sys.stderr.write(f"hidden states dump: removing {key!r} returned {status}\n")


def main(argv: List[str]) -> int:
    """python store_process.py SOCKET_FD DUMP_DIR MANIFEST_NAME THREADS PARENT_PID SETTINGS_JSON"""
    fd, dump_dir, manifest_name, threads, parent_pid, settings = argv
    files.die_with_parent(int(parent_pid))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=int(fd))
    settings = json.loads(settings)
    try:
        store, put_config = connect(settings)
    except Exception as e:
        sock.sendall(files.pickle.dumps(("unusable", str(e))))
        return 1
    writer = StoreWriterProcess(sock, dump_dir, manifest_name, int(threads), settings, store, put_config)
    if writer.layout == "specforge":
        republished = writer.publish_missing_refs()
        if republished:
            print(f"hidden states dump: published {republished} refs a killed writer had left out of "
                  f"{store_layouts.REF_CHANNEL}", file=sys.stderr, flush=True)
    writer.answer(("ready",))
    writer.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
