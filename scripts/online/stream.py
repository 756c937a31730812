"""The trainer's side of the online sink: the samples SGLang servers publish to a Mooncake
store, as a PyTorch IterableDataset, each read once, in the offline exports' field names.

    stream = HiddenStatesStream(control_dir, rank=rank, world_size=world_size)
    loader = DataLoader(stream, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    for sample in loader:
        train(sample)
        stream.ack([sample["sample_id"]])

(Workers forked from a process that holds a Mooncake client cannot open their own: spawn
them, or fork them once, with persistent_workers=True, before the first ack.)

A server dumping with SGLANG_HS_DUMP_SINK=mooncake puts each sample's tensors in the store,
then appends its manifest line (its keys, shapes and dtypes) to the control directory. The
stream follows every manifest there and hands each sample to one trainer rank and one
dataloader worker, by a stable hash of its sample id (the rank by the hash alone, so a
trainer restarted with another number of workers keeps its samples). It ends once the
control directory holds CLOSED_MARKER (every sample is published) and every line is read.

Each sample read is checked against the checksums its manifest line carries (each object's
in SpecForge's layout, each tensor's in hs-connectors'): an object that is not the one the
writer put (a stale or foreign object under a reused key, bytes changed in the store) is
refused with ChecksumMismatch naming the sample and the key. A sample whose rows hold NaN or
infinity (its line's nonfinite_rows) is skipped unless `keep_nonfinite`, and the rank's next
`ack` logs it with the samples acknowledged and removes its objects (skipped, it is never
acknowledged by a trainer, and would stay pinned); lines written before checksums are read
unchecked.

`ack` records the samples a trainer has trained on, durably, and only then removes them from
the store; a stream started later (a restarted trainer) skips every acknowledged sample, so
no sample is lost and none is trained on twice once acknowledged. A trainer killed between the
record and the last remove leaves hard-pinned objects, which the store never evicts: the
stream started again removes them (its first `ack`, and its iteration as it passes them).

Imports nothing from SGLang: torch, the standard library, Mooncake's store and the dump's
format module (hs_connectors too, only for samples in its layout).
"""

import hashlib
import json
import math
import os
import re
import time
import dataclasses
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Set

import torch

from scripts.dump_format import (
    CHECKSUM_FIELD,
    FP8_ENCODING,
    ManifestFollower,
    MooncakeSettings,
    check_checksum,
    dequantize_rows,
    nonfinite_rows,
)

# Created in the control directory once every sample is published: the stream ends there.
CLOSED_MARKER = ".closed"
ACKS_DIR = "acks"
FIELD_SETS = ("specforge", "speculators")
LAYOUTS = ("specforge", "hs-connectors")
SINK = "mooncake"
OBJECT_NOT_FOUND = -704  # Mooncake's status for a key it does not hold
BUFFER_GRANULE = 64 << 20  # read buffers grow by this much, so few are ever registered
OBJECT_ALIGNMENT = 64


# A reader lends the store no memory, and its reads land in buffers registered for them
# (get_into), so the client's own buffer carries next to nothing.
READER_DEFAULTS = MooncakeSettings(global_segment_size=0, local_buffer_size=16 << 20)


def reader_settings(environ: Mapping[str, str]) -> MooncakeSettings:
    """How a trainer's process reaches the store: the MOONCAKE_* variables the servers'
    writers read (store_settings), with a reader's defaults."""
    settings = MooncakeSettings.from_env(environ, defaults=READER_DEFAULTS)
    return dataclasses.replace(settings, global_segment_size=0)


def setup_error(settings: MooncakeSettings, status) -> str:
    return (f"could not join the Mooncake store whose master is {settings.master_server_addr} "
            f"(MOONCAKE_MASTER_SERVER_ADDR; metadata {settings.metadata_server}, protocol {settings.protocol}, "
            f"this host {settings.local_hostname}): setup returned {status}. Is mooncake_master running there?")


def torch_dtype(name: str) -> torch.dtype:
    """A dtype as the manifest names it: "bfloat16", or "torch.bfloat16" as hs-connectors does."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class StoreReader:
    """One process's client of the store: reads objects into one registered buffer (grown,
    and registered again, only when a sample needs more) and removes objects."""

    def __init__(self, settings: MooncakeSettings):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as error:
            raise ImportError("the online stream reads a Mooncake store: install Mooncake's Python "
                              "package (mooncake-transfer-engine) in the trainer's environment") from error
        self._store = MooncakeDistributedStore()
        status = self._store.setup(settings.local_hostname, settings.metadata_server, 0, settings.local_buffer_size,
                                   settings.protocol, settings.rdma_devices, settings.master_server_addr)
        if status != 0:
            raise ConnectionError(setup_error(settings, status))
        self._buffer: Optional[torch.Tensor] = None

    def read(self, rid: str, objects: Dict[str, dict]) -> Dict[str, torch.Tensor]:
        """The tensors of one sample's objects ({name: {key, shape, dtype}}), as they are stored."""
        placed = []  # (name, spec, dtype, offset, size)
        offset = 0
        for name, spec in objects.items():
            dtype = torch_dtype(spec["dtype"])
            size = self._store.get_size(spec["key"])
            expected = math.prod(spec["shape"]) * dtype.itemsize
            if size < 0:
                raise LookupError(f"manifest line of rid {rid!r}: its object {spec['key']} is not in the store "
                                  f"(status {size}): removed, or the store lost it")
            if size != expected:
                raise ValueError(f"manifest line of rid {rid!r}: its object {spec['key']} holds {size} bytes, "
                                 f"its shape {spec['shape']} and dtype {spec['dtype']} {expected}")
            placed.append((name, spec, dtype, offset, size))
            offset += -(-size // OBJECT_ALIGNMENT) * OBJECT_ALIGNMENT
        buffer = self._buffer_of(offset)
        tensors = {}
        for name, spec, dtype, start, size in placed:
            received = self._store.get_into(spec["key"], buffer.data_ptr() + start, size)
            if received != size:
                raise LookupError(f"manifest line of rid {rid!r}: reading its object {spec['key']} "
                                  f"returned {received}, not its {size} bytes")
            # A copy: the buffer is the next sample's.
            stored = buffer[start:start + size].clone()
            check_checksum(f"the object {spec['key']} of rid {rid!r}", spec.get(CHECKSUM_FIELD),
                           [stored.numpy()])
            tensors[name] = stored.view(dtype).view(spec["shape"])
        return tensors

    def remove(self, key: str) -> None:
        # force: a sample just read still holds a lease on its objects.
        status = self._store.remove(key, force=True)
        if status not in (0, OBJECT_NOT_FOUND):
            raise RuntimeError(f"Mooncake remove of {key} failed with status {status}")

    def _buffer_of(self, size: int) -> torch.Tensor:
        if self._buffer is not None and self._buffer.numel() >= size:
            return self._buffer
        if self._buffer is not None:
            self._store.unregister_buffer(self._buffer.data_ptr())
        buffer = torch.empty(-(-max(size, 1) // BUFFER_GRANULE) * BUFFER_GRANULE, dtype=torch.uint8)
        status = self._store.register_buffer(buffer.data_ptr(), buffer.numel())
        if status != 0:
            raise RuntimeError(f"Mooncake register_buffer of {buffer.numel()} bytes failed with status {status}")
        self._buffer = buffer
        return buffer


def hs_connectors_store(settings: MooncakeSettings):
    """hs-connectors' own reader of its layout, joined as a reader (no global segment)."""
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

    config = MooncakeStoreConfig(local_hostname=settings.local_hostname, metadata_server=settings.metadata_server,
                                 master_server_address=settings.master_server_addr, global_segment_size=0,
                                 local_buffer_size=settings.local_buffer_size, protocol=settings.protocol,
                                 device_name=settings.rdma_devices)
    try:
        return MooncakeHiddenStatesStore(config).setup()
    except RuntimeError as error:
        raise ConnectionError(setup_error(settings, error)) from error


def check_entry(entry: dict) -> None:
    """Refuse a manifest line this stream cannot read, naming its rid."""
    rid = entry.get("rid")
    if entry.get("sink") != SINK:
        raise ValueError(f"manifest line of rid {rid!r} is not the Mooncake sink's (its sink: {entry.get('sink')!r}): "
                         f"the control directory of an online stream holds only SGLANG_HS_DUMP_SINK=mooncake manifests")
    if entry.get("layout") not in LAYOUTS:
        raise ValueError(f"manifest line of rid {rid!r} has the layout {entry.get('layout')!r}; "
                         f"this stream reads {', '.join(LAYOUTS)}")
    if entry["layout"] == "specforge" and entry.get("encoding") == FP8_ENCODING:
        raise ValueError(f"manifest line of rid {rid!r}: fp8 in the specforge layout, which holds only plain tensors")


def object_keys(entry: dict) -> List[str]:
    """Every store key of a sample (hs-connectors: also its error marker's)."""
    if entry["layout"] == "specforge":
        return [spec["key"] for spec in entry["objects"].values()]
    handle = entry["transfer_manifest"]["handle"]
    return [handle, f"{handle}:error"]


def sample_hash(sample_id: str) -> int:
    """The same in every process (Python's own hash of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(sample_id.encode("utf-8"), digest_size=8).digest(), "little")


def rank_of(sample_id: str, world_size: int) -> int:
    """The trainer rank a sample belongs to, whatever the ranks' numbers of workers."""
    return sample_hash(sample_id) % world_size


def worker_of(sample_id: str, world_size: int, num_workers: int) -> int:
    """The dataloader worker, of its rank's, that reads a sample."""
    return sample_hash(sample_id) // world_size % num_workers


def ack_log_path(state_dir, rank: int) -> Path:
    return Path(state_dir) / ACKS_DIR / f"rank{rank}.jsonl"


def removed_mark_path(ack_log: Path) -> Path:
    """Where a rank records how much of its ack log has its objects removed (a byte offset)."""
    return ack_log.with_suffix(".removed")


def logged_ids(path: Path, start: int = 0) -> List[str]:
    """The sample ids of an ack log's complete lines from byte `start`. A line a killed
    trainer left unfinished is not an acknowledgement (its samples' objects were not removed yet)."""
    data = path.read_bytes()
    return [json.loads(line)["sample_id"] for line in data[start:data.rfind(b"\n") + 1].splitlines()
            if line.strip()]


def removed_offset(ack_log: Path) -> int:
    try:
        return int(removed_mark_path(ack_log).read_text())
    except (FileNotFoundError, ValueError):
        return 0  # none yet, or cut short by a kill: the whole log may still have objects


def ack_logs(state_dir) -> List[Path]:
    return sorted((Path(state_dir) / ACKS_DIR).glob("rank*.jsonl"))


def acknowledged(state_dir) -> Set[str]:
    """The sample ids in every rank's ack log."""
    return {sample_id for path in ack_logs(state_dir) for sample_id in logged_ids(path)}


def acknowledged_unremoved(state_dir) -> Set[str]:
    """The acknowledged samples whose objects may still be in the store: those logged by a
    trainer killed before it removed them all, in every rank's log (another world size puts
    a sample in another rank)."""
    return {sample_id for path in ack_logs(state_dir) for sample_id in logged_ids(path, removed_offset(path))}


def acknowledged_count(state_dir) -> int:
    """How many samples the trainers have acknowledged, over every rank: what producers
    pace themselves by. `state_dir`: the streams' state_dir, by default their control directory."""
    return len(acknowledged(state_dir))


class AckLog:
    """One trainer rank's durable record of the samples it trained on."""

    def __init__(self, state_dir, rank: int):
        self.path = ack_log_path(state_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        # A line a killed trainer left unfinished goes, or the next append would join it.
        data = self.path.read_bytes()
        os.ftruncate(self._fd, data.rfind(b"\n") + 1)
        if created:  # the log's name must survive a crash too
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)

    def append(self, sample_ids: List[str]) -> None:
        lines = "".join(json.dumps({"sample_id": sample_id}) + "\n" for sample_id in sample_ids)
        os.write(self._fd, lines.encode("utf-8"))
        os.fsync(self._fd)

    def unremoved(self) -> List[str]:
        """The samples of this log whose objects may still be in the store."""
        return logged_ids(self.path, removed_offset(self.path))

    def mark_removed(self) -> None:
        """Record that every sample logged so far has its objects removed. Not synced: a mark
        lost to a crash only has a restarted stream remove them again (a no-op)."""
        mark = removed_mark_path(self.path)
        written = mark.with_suffix(".removed.tmp")
        written.write_text(str(os.fstat(self._fd).st_size))
        os.replace(written, mark)


# The process that opened a Mooncake client here: a process forked from it cannot open one
# of its own (the client hangs or crashes there).
_client_process: Optional[int] = None


def opened_a_client() -> None:
    global _client_process
    _client_process = os.getpid()


def refuse_a_client_in_a_fork() -> None:
    if _client_process not in (None, os.getpid()):
        raise RuntimeError(
            "this process was forked from one that holds a Mooncake client (a stream there read or "
            "acknowledged samples), and Mooncake cannot open another client in a fork: start the "
            "DataLoader's workers with multiprocessing_context='spawn' (or 'forkserver'), or with "
            "persistent_workers=True before the first ack")


class ProcessConnections:
    """What one process holds open; a dataloader worker (spawned or forked) opens its own."""

    def __init__(self):
        self.pid = os.getpid()
        self.reader: Optional[StoreReader] = None
        self.hs_connectors_store = None
        self.ack_log: Optional[AckLog] = None
        self.ack_follower: Optional[ManifestFollower] = None
        self.unacknowledged_keys: Dict[str, List[str]] = {}  # this rank's sample ids: their store keys
        self.unremoved_keys: Dict[str, List[str]] = {}  # acknowledged before a kill: their store keys
        self.skipped: Dict[str, None] = {}  # this rank's samples flagged nonfinite, left to log and remove


class HiddenStatesStream(torch.utils.data.IterableDataset):
    """Every published sample of `control_dir`'s manifests that belongs to this trainer
    rank and dataloader worker and is not acknowledged yet, read from the store, as a dict:

    fields "specforge" (export_specforge's): input_ids [T] int64, loss_mask [T] int64,
    hidden_state [1, T, H] (the final normed state), aux_hidden_state [1, T, K*H] (the dumped
    layers in ascending order, side by side);
    fields "speculators": input_ids [T], loss_mask [T], hidden_states [T, K, H] (the dumped
    layers in the manifest's `layers` order);
    both with "sample_id", which `ack` takes. fp8 samples come back in the model's dtype.

    Store settings come from the MOONCAKE_* variables of `store_env` (default: this process's
    environment). The ack logs live in `state_dir` (default: the control directory).
    Iteration waits for new manifest lines until the closed marker is there; with
    `idle_timeout_s`, no new line for that long is a TimeoutError. Samples with rows that
    hold NaN or infinity are skipped (counted in `skipped_nonfinite`) unless `keep_nonfinite`."""

    def __init__(self, control_dir, *, rank: int = 0, world_size: int = 1, fields: str = "specforge",
                 state_dir=None, store_env: Optional[Mapping[str, str]] = None,
                 idle_timeout_s: Optional[float] = None, poll_interval_s: float = 0.05,
                 keep_nonfinite: bool = False):
        super().__init__()
        if fields not in FIELD_SETS:
            raise ValueError(f"fields={fields!r}: use one of {', '.join(FIELD_SETS)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not one of world_size {world_size}'s ranks")
        self.control_dir = Path(control_dir)
        self.state_dir = Path(state_dir) if state_dir is not None else self.control_dir
        self.rank = rank
        self.world_size = world_size
        self.fields = fields
        self.settings = reader_settings(os.environ if store_env is None else store_env)
        self.idle_timeout_s = idle_timeout_s
        self.poll_interval_s = poll_interval_s
        self.keep_nonfinite = keep_nonfinite
        self.skipped_nonfinite: List[str] = []  # sample ids, in this process
        self._connections: Optional[ProcessConnections] = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_connections"] = None
        return state

    def __iter__(self) -> Iterator[Dict[str, object]]:
        worker = torch.utils.data.get_worker_info()
        num_workers, worker_id = (1, 0) if worker is None else (worker.num_workers, worker.id)
        acknowledged_or_yielded = acknowledged(self.state_dir)
        # Each worker its own share: a trainer killed mid-ack may never ack again to remove them.
        unremoved = acknowledged_unremoved(self.state_dir)
        for entry in self._published():
            sample_id = entry["sample_id"]
            if (rank_of(sample_id, self.world_size) != self.rank
                    or worker_of(sample_id, self.world_size, num_workers) != worker_id):
                continue
            if sample_id in unremoved:
                unremoved.discard(sample_id)
                self._remove(object_keys(entry))
            if sample_id in acknowledged_or_yielded:
                continue
            acknowledged_or_yielded.add(sample_id)  # a line repeated in the manifests is one sample
            if nonfinite_rows(entry) and not self.keep_nonfinite:
                self.skipped_nonfinite.append(sample_id)
                continue
            yield self._sample(entry)

    def ack(self, sample_ids: Iterable[str]) -> None:
        """Record that this rank trained on `sample_ids` (appended to its ack log and synced
        to disk), then remove their objects from the store. Works in the trainer's main
        process while dataloader workers iterate."""
        sample_ids = list(sample_ids)
        connections = self._process_connections()
        if connections.ack_follower is None:
            connections.ack_follower = ManifestFollower(self.control_dir)
            connections.ack_log = AckLog(self.state_dir, self.rank)
            # What a trainer killed mid-ack left (a rank's log may name samples another world
            # size gives another rank): removed below, before a mark says it is gone.
            connections.unremoved_keys = dict.fromkeys(connections.ack_log.unremoved(), [])
        for entry in connections.ack_follower.poll():
            check_entry(entry)
            if rank_of(entry["sample_id"], self.world_size) == self.rank:
                connections.unacknowledged_keys[entry["sample_id"]] = object_keys(entry)
                if nonfinite_rows(entry) and not self.keep_nonfinite:
                    connections.skipped[entry["sample_id"]] = None
            if entry["sample_id"] in connections.unremoved_keys:
                connections.unremoved_keys[entry["sample_id"]] = object_keys(entry)
        unknown = [sample_id for sample_id in sample_ids if sample_id not in connections.unacknowledged_keys]
        if unknown:
            raise ValueError(f"not samples of rank {self.rank} in {self.control_dir}'s manifests left to "
                             f"acknowledge: {unknown}")
        for sample_id in list(connections.unremoved_keys):
            self._remove(connections.unremoved_keys.pop(sample_id))
        # With them, the rank's skipped samples seen so far: logged and removed like them.
        logged = list(dict.fromkeys(sample_ids + [sample_id for sample_id in connections.skipped
                                                  if sample_id in connections.unacknowledged_keys]))
        connections.skipped.clear()
        connections.ack_log.append(logged)
        for sample_id in logged:
            self._remove(connections.unacknowledged_keys.pop(sample_id))
        connections.ack_log.mark_removed()

    def _remove(self, keys: List[str]) -> None:
        reader = self._reader()
        for key in keys:
            reader.remove(key)

    def _published(self) -> Iterator[dict]:
        """Every manifest line, as writers append them, until the closed marker."""
        follower = ManifestFollower(self.control_dir)
        closed_marker = self.control_dir / CLOSED_MARKER
        last_line_at = time.monotonic()
        while True:
            # Looked at before reading: every line was appended before the marker was made.
            closed = closed_marker.exists()
            entries = follower.poll()
            for entry in entries:
                check_entry(entry)
                yield entry
            if closed:
                return
            if entries:
                last_line_at = time.monotonic()
            elif self.idle_timeout_s is not None and time.monotonic() - last_line_at > self.idle_timeout_s:
                raise TimeoutError(f"no new manifest line in {self.control_dir} for {self.idle_timeout_s} s, "
                                   f"and no {CLOSED_MARKER} marker saying every sample is published")
            else:
                time.sleep(self.poll_interval_s)

    def _sample(self, entry: dict) -> Dict[str, object]:
        rid = entry["rid"]
        if entry["layout"] == "specforge":
            stored = self._reader().read(rid, entry["objects"])
            num_tokens = entry["num_tokens"]
            token_ids = stored["input_ids"][0]
            loss_mask = stored["loss_mask"][0]
            hidden_states = stored["hidden_state"].view(num_tokens, len(entry["layers"]), entry["hidden_size"])
            last_hidden_state = stored["target"][0]
        else:
            handle = entry["transfer_manifest"]["handle"]
            try:
                # No waiting: a sample has its manifest line only once it is in the store.
                stored = self._hs_connectors_store().get_sample(entry["transfer_manifest"], timeout=0)
            except TimeoutError as error:
                raise LookupError(f"manifest line of rid {rid!r}: its object {handle} is not in the store: "
                                  f"removed, or the store lost it") from error
            for name, spec in entry["transfer_manifest"]["tensors"].items():
                check_checksum(f"the tensor {name} of the object {handle} of rid {rid!r}", spec.get(CHECKSUM_FIELD),
                               [stored[name].contiguous().view(-1).view(torch.uint8).numpy()])
            token_ids = stored["token_ids"]
            loss_mask = stored["loss_mask"]
            hidden_states = stored["hidden_states"]
            last_hidden_state = stored["last_hidden_state"]
            if entry.get("encoding") == FP8_ENCODING:
                dtype = torch_dtype(entry["model_dtype"])
                hidden_states = dequantize_rows(hidden_states, stored["hidden_states_scale"], dtype)
                last_hidden_state = dequantize_rows(last_hidden_state, stored["last_hidden_state_scale"], dtype)
        sample: Dict[str, object] = {"input_ids": token_ids, "loss_mask": loss_mask}
        if self.fields == "speculators":
            sample["hidden_states"] = hidden_states
        else:
            layers = entry["layers"]
            if layers != sorted(layers):  # SGLang feeds an EAGLE-3 draft its layers in ascending order
                order = sorted(range(len(layers)), key=layers.__getitem__)
                hidden_states = hidden_states.index_select(1, torch.tensor(order))
            num_tokens, num_layers, hidden_size = hidden_states.shape
            sample["hidden_state"] = last_hidden_state.unsqueeze(0)
            sample["aux_hidden_state"] = hidden_states.reshape(num_tokens, num_layers * hidden_size).unsqueeze(0)
        sample["sample_id"] = entry["sample_id"]
        return sample

    def _process_connections(self) -> ProcessConnections:
        if self._connections is None or self._connections.pid != os.getpid():
            refuse_a_client_in_a_fork()
            self._connections = ProcessConnections()
        return self._connections

    def _reader(self) -> StoreReader:
        connections = self._process_connections()
        if connections.reader is None:
            connections.reader = StoreReader(self.settings)
            opened_a_client()
        return connections.reader

    def _hs_connectors_store(self):
        connections = self._process_connections()
        if connections.hs_connectors_store is None:
            connections.hs_connectors_store = hs_connectors_store(self.settings)
            opened_a_client()
        return connections.hs_connectors_store
