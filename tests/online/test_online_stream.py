"""HiddenStatesStream against a real local Mooncake master: samples published as the Mooncake
sink's writer publishes them (objects in the store, then a manifest line in the control
directory), read back bit for bit in both layouts and both field sets, split across trainer
ranks and dataloader workers, acknowledged durably, and a killed trainer restarted.

The publisher here is written from the sink's contract, not from the server's writer, so
the stream is checked against the contract and not against the writer's own reading of it.
"""

import json
import multiprocessing
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import zlib
from types import SimpleNamespace
from typing import Dict, List, Tuple

import pytest
import torch
from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig, packed_layout
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

from scripts.online import stream as stream_module
from scripts.online.master import MooncakeMaster
from scripts.online.stream import CLOSED_MARKER, AckLog, HiddenStatesStream, acknowledged, acknowledged_count
from scripts.dump_format import ChecksumMismatch, FP8_ENCODING, checksum_of, dequantize_rows, manifest_name, quantize_rows

NUM_TOKENS = 5
HIDDEN_SIZE = 8
STORE_MEMORY = 256 << 20  # what the store's own client lends it
PUBLISHER_BUFFER = 16 << 20
WAIT_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def master():
    with MooncakeMaster(segment_size=STORE_MEMORY) as running:
        yield running


@pytest.fixture
def control_dir(tmp_path):
    path = tmp_path / "control"
    path.mkdir()
    return path


def same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return (actual.dtype == expected.dtype and actual.shape == expected.shape
            and torch.equal(actual.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)))


def dump_tensors(sample_id: str, layers: List[int], fp8: bool = False) -> Dict[str, torch.Tensor]:
    """One sample's tensors as the dump makes them (fp8: quantized with the dump's scales);
    random, and the same for the same sample id."""
    generator = torch.Generator().manual_seed(zlib.crc32(sample_id.encode()))
    tensors = {
        "token_ids": torch.randint(0, 1000, (NUM_TOKENS,), generator=generator),
        "hidden_states": torch.randn(NUM_TOKENS, len(layers), HIDDEN_SIZE, generator=generator).to(torch.bfloat16),
        "last_hidden_state": torch.randn(NUM_TOKENS, HIDDEN_SIZE, generator=generator).to(torch.bfloat16),
        "loss_mask": torch.randint(0, 2, (NUM_TOKENS,), generator=generator),
    }
    if fp8:
        for name in ("hidden_states", "last_hidden_state"):
            tensors[name], tensors[f"{name}_scale"] = quantize_rows(tensors[name])
    return tensors


def expected_fields(tensors: Dict[str, torch.Tensor], layers: List[int], fields: str) -> Dict[str, torch.Tensor]:
    """What the exports would hold for a sample: export_specforge's or export_speculators' fields."""
    hidden_states, last_hidden_state = tensors["hidden_states"], tensors["last_hidden_state"]
    if "hidden_states_scale" in tensors:
        hidden_states = dequantize_rows(hidden_states, tensors["hidden_states_scale"], torch.bfloat16)
        last_hidden_state = dequantize_rows(last_hidden_state, tensors["last_hidden_state_scale"], torch.bfloat16)
    expected = {"input_ids": tensors["token_ids"], "loss_mask": tensors["loss_mask"]}
    if fields == "speculators":
        expected["hidden_states"] = hidden_states
    else:
        expected["hidden_state"] = last_hidden_state[None]
        ascending = [hidden_states[:, layers.index(layer)] for layer in sorted(layers)]
        expected["aux_hidden_state"] = torch.cat(ascending, dim=-1)[None]
    return expected


class Publisher:
    """Publishes samples as the Mooncake sink's writer does, in one layout under one writer
    id: the sample's objects in the store (hard-pinned, in memory the writer does not lend),
    then its line in the writer's manifest."""

    def __init__(self, control_dir, env: Dict[str, str], layout: str, writer_id: str):
        self.control_dir = control_dir
        self.layout = layout
        self.writer_id = writer_id
        self.published: Dict[str, dict] = {}  # sample id: its manifest line
        settings = dict(local_hostname=env["MOONCAKE_LOCAL_HOSTNAME"], metadata_server=env["MOONCAKE_METADATA_SERVER"],
                        global_segment_size=0, local_buffer_size=PUBLISHER_BUFFER,
                        protocol=env["MOONCAKE_PROTOCOL"])
        if layout == "specforge":
            self.store = MooncakeDistributedStore()
            assert self.store.setup(*settings.values(), "", env["MOONCAKE_MASTER_SERVER_ADDR"]) == 0
        else:
            self.hs_store = MooncakeHiddenStatesStore(MooncakeStoreConfig(
                **settings, master_server_address=env["MOONCAKE_MASTER_SERVER_ADDR"])).setup()
            self.store = self.hs_store._store  # its client, which the tests look objects up with

    def publish(self, index: int, layers: List[int], fp8: bool = False, checksums: bool = True,
                nonfinite_rows: int = 0) -> str:
        """Publish this writer's sample `index` (its tensors: dump_tensors of the id returned),
        its line with the checksum of each object (SpecForge's layout) or tensor (hs-connectors'),
        unless not `checksums` (a line written before checksums), and `nonfinite_rows`."""
        sample_id = f"{self.writer_id}-dp0-run1-{index:09d}"
        tensors = dump_tensors(sample_id, layers, fp8)
        store_id = f"test-{self.control_dir.parent.name}"
        line = {
            "rid": f"rid-{sample_id}", "num_tokens": NUM_TOKENS, "layers": layers, "hidden_size": HIDDEN_SIZE,
            "dtype": "float8_e4m3fn" if fp8 else "bfloat16", "layer_convention": "id i: ...",
            "eagle3_draft_layer_ids": [], "sink": "mooncake", "layout": self.layout, "sample_id": sample_id,
            "encoding": FP8_ENCODING if fp8 else "plain", "model_dtype": "bfloat16",
            "nonfinite_rows": nonfinite_rows,
        }
        if self.layout == "specforge":
            line["objects"], line["bytes"] = self._put_objects(f"{store_id}/{sample_id}/g1", tensors)
        else:
            line["transfer_manifest"] = self._put_packed(f"{store_id}/{sample_id}", tensors)
            line["bytes"] = line["transfer_manifest"]["metadata"]["total_aligned_bytes"]
        specs = line["objects"] if self.layout == "specforge" else line["transfer_manifest"]["tensors"]
        for spec in specs.values():
            stored = spec.pop("stored")
            if checksums:
                spec["checksum"] = checksum_of([stored.contiguous().view(-1).view(torch.uint8).numpy()])
        with open(self.control_dir / manifest_name(0, self.writer_id), "a") as manifest:
            manifest.write(json.dumps(line) + "\n")
        self.published[sample_id] = line
        return sample_id

    def _put_objects(self, prefix: str, tensors: Dict[str, torch.Tensor]) -> Tuple[Dict[str, dict], int]:
        num_tokens, num_layers, hidden_size = tensors["hidden_states"].shape
        objects = {
            "hidden_state": tensors["hidden_states"].reshape(1, num_tokens, num_layers * hidden_size),
            "target": tensors["last_hidden_state"][None],
            "input_ids": tensors["token_ids"][None],
            "loss_mask": tensors["loss_mask"][None],
            "attention_mask": torch.ones(1, num_tokens, dtype=torch.int64),
        }
        hard_pinned = ReplicateConfig()
        hard_pinned.replica_num = 1
        hard_pinned.with_hard_pin = True
        specs = {}
        for name, tensor in objects.items():
            key = f"{prefix}/{name}"
            assert self.store.put(key, tensor.contiguous().view(torch.uint8).numpy().tobytes(), hard_pinned) == 0
            specs[name] = {"key": key, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                           "stored": tensor}
        return specs, sum(tensor.nbytes for tensor in objects.values())

    def _put_packed(self, handle: str, tensors: Dict[str, torch.Tensor]) -> dict:
        specs, total_bytes = packed_layout({name: (tuple(tensor.shape), tensor.dtype)
                                            for name, tensor in tensors.items()})
        transfer_manifest = {"handle": handle, "version": 1, "tensors": specs,
                             "metadata": {"num_tokens": NUM_TOKENS, "total_aligned_bytes": total_bytes,
                                          "extract_mode": "sglang-hidden-states-dump"}}
        self.hs_store.put_sample(transfer_manifest, tensors)
        read_back = json.loads(json.dumps(transfer_manifest))  # as a reader gets it from the manifest
        for name, spec in read_back["tensors"].items():
            spec["stored"] = tensors[name]
        return read_back

    def object_keys(self, sample_id: str) -> List[str]:
        line = self.published[sample_id]
        if self.layout == "specforge":
            return [spec["key"] for spec in line["objects"].values()]
        return [line["transfer_manifest"]["handle"]]

    def in_store(self, sample_id: str) -> bool:
        sizes = [self.store.get_size(key) for key in self.object_keys(sample_id)]
        assert all(size >= 0 for size in sizes) or all(size < 0 for size in sizes), sizes
        return sizes[0] >= 0


    def overwrite(self, sample_id: str, other: str) -> None:
        """Put sample `other`'s bytes under `sample_id`'s keys, as a stale or foreign object
        under a reused key would be: same sizes, other bytes."""
        line = self.published[sample_id]
        tensors = dump_tensors(other, line["layers"])
        hard_pinned = ReplicateConfig()
        hard_pinned.replica_num = 1
        hard_pinned.with_hard_pin = True
        if self.layout == "specforge":
            spec = line["objects"]["hidden_state"]
            assert self.store.remove(spec["key"], force=True) == 0
            value = tensors["hidden_states"].contiguous().view(torch.uint8).numpy().tobytes()
            assert self.store.put(spec["key"], value, hard_pinned) == 0
        else:
            manifest = line["transfer_manifest"]
            self.hs_store.delete_sample(manifest["handle"])
            self.hs_store.put_sample(manifest, tensors)


def close(control_dir) -> None:
    (control_dir / CLOSED_MARKER).touch()


LAYOUT_CASES = [("specforge", [1, 2, 3], False),  # that layout holds the layers in ascending order
                ("hs-connectors", [3, 1, 2], False),  # any order: the specforge fields sort them
                ("hs-connectors", [3, 1, 2], True)]


@pytest.mark.parametrize("fields", ["specforge", "speculators"])
@pytest.mark.parametrize("layout,layers,fp8", LAYOUT_CASES, ids=["specforge", "hs-connectors", "hs-connectors-fp8"])
def test_samples_come_back_bit_for_bit_in_the_exports_fields(master, control_dir, layout, layers, fp8, fields):
    publishers = [Publisher(control_dir, master.env(), layout, writer_id) for writer_id in ("a", "b")]
    expected = {}
    for index in range(3):
        for publisher in publishers:
            sample_id = publisher.publish(index, layers, fp8)
            expected[sample_id] = expected_fields(dump_tensors(sample_id, layers, fp8), layers, fields)
    close(control_dir)

    samples = {sample["sample_id"]: sample for sample in HiddenStatesStream(control_dir, fields=fields,
                                                                            store_env=master.env())}
    assert samples.keys() == expected.keys()
    for sample_id, sample in samples.items():
        assert sample.keys() == {*expected[sample_id], "sample_id"}
        for name, tensor in expected[sample_id].items():
            assert same_bits(sample[name], tensor), (sample_id, name)


def test_every_sample_once_across_trainer_ranks_and_dataloader_workers(master, control_dir):
    publishers = [Publisher(control_dir, master.env(), "specforge", "a"),
                  Publisher(control_dir, master.env(), "hs-connectors", "b")]
    for index in range(12):
        for publisher in publishers:
            publisher.publish(index, [1, 2, 3])
    close(control_dir)
    every_sample = {sample_id for publisher in publishers for sample_id in publisher.published}

    # Not forked from this process, which holds Mooncake clients: from a fork server that has
    # imported the stream (and torch) once for every worker.
    fork_server = multiprocessing.get_context("forkserver")
    fork_server.set_forkserver_preload(["scripts.online.stream"])
    seen_by_rank = []
    for rank in range(2):
        stream = HiddenStatesStream(control_dir, rank=rank, world_size=2, store_env=master.env())
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2,
                                             multiprocessing_context=fork_server)
        seen = []
        for sample in loader:
            seen.append(sample["sample_id"])
            stream.ack([sample["sample_id"]])  # from the main process, while the workers read
        seen_by_rank.append(seen)

    all_seen = [sample_id for seen in seen_by_rank for sample_id in seen]
    assert sorted(all_seen) == sorted(every_sample)  # each exactly once
    assert all(0 < len(seen) < len(every_sample) for seen in seen_by_rank)  # a split, not one rank's
    assert acknowledged_count(control_dir) == len(every_sample)
    assert not any(publisher.in_store(sample_id) for publisher in publishers for sample_id in publisher.published)


def test_each_rank_and_worker_reads_a_share_of_its_own(master, control_dir, monkeypatch):
    """The split itself, every (rank, worker) iterated in this process as that worker."""
    publisher = Publisher(control_dir, master.env(), "specforge", "a")
    every_sample = {publisher.publish(index, [1, 2, 3]) for index in range(24)}
    close(control_dir)

    shares = []
    for rank in range(2):
        stream = HiddenStatesStream(control_dir, rank=rank, world_size=2, store_env=master.env())
        for worker in range(2):
            monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: SimpleNamespace(id=worker, num_workers=2))
            shares.append([sample["sample_id"] for sample in stream])
    assert sorted(sample_id for share in shares for sample_id in share) == sorted(every_sample)
    assert all(shares)


def test_a_restarted_trainer_yields_only_unacknowledged_samples(master, control_dir, tmp_path):
    publishers = [Publisher(control_dir, master.env(), "specforge", "a"),
                  Publisher(control_dir, master.env(), "hs-connectors", "b")]
    for index in range(4):
        for publisher in publishers:
            publisher.publish(index, [1, 2, 3])
    close(control_dir)
    state_dir = tmp_path / "state"

    stream = HiddenStatesStream(control_dir, state_dir=state_dir, store_env=master.env())
    first_run = [sample["sample_id"] for sample in stream]
    trained = first_run[::2]
    with pytest.raises(ValueError, match="no-such-sample"):
        stream.ack([*trained, "no-such-sample"])
    assert acknowledged_count(state_dir) == 0  # refused before anything was recorded
    stream.ack(trained)

    assert acknowledged(state_dir) == set(trained)
    assert acknowledged_count(state_dir) == len(trained)
    for publisher in publishers:
        for sample_id in publisher.published:
            assert publisher.in_store(sample_id) == (sample_id not in trained), sample_id
    restarted = HiddenStatesStream(control_dir, state_dir=state_dir, store_env=master.env())
    assert [sample["sample_id"] for sample in restarted] == first_run[1::2]


def test_without_acks_a_restarted_trainer_yields_every_sample_again(master, control_dir):
    publisher = Publisher(control_dir, master.env(), "specforge", "a")
    for index in range(4):
        publisher.publish(index, [1, 2, 3])
    close(control_dir)

    first_run = [sample["sample_id"] for sample in HiddenStatesStream(control_dir, store_env=master.env())]
    restarted = [sample["sample_id"] for sample in HiddenStatesStream(control_dir, store_env=master.env())]
    assert sorted(first_run) == sorted(publisher.published)
    assert restarted == first_run
    assert acknowledged_count(control_dir) == 0


# A trainer that acknowledges each sample when told to on stdin, then says so on stdout.
TRAINER = textwrap.dedent("""
    import sys
    from scripts.online.stream import HiddenStatesStream
    stream = HiddenStatesStream(sys.argv[1])
    for sample in stream:
        if sys.stdin.readline() != "ack\\n":
            break
        stream.ack([sample["sample_id"]])
        print(sample["sample_id"], flush=True)
""")


def read_line(process: subprocess.Popen) -> str:
    """The trainer's next line, waiting until it writes one (or ends)."""
    ready, _, _ = select.select([process.stdout], [], [], WAIT_TIMEOUT_S)
    assert ready, "the trainer wrote nothing"
    line = process.stdout.readline()
    assert line, f"the trainer ended with status {process.wait()}"
    return line.strip()


def test_a_killed_trainer_restarted_trains_on_every_sample_exactly_once(master, control_dir):
    publisher = Publisher(control_dir, master.env(), "specforge", "a")
    for index in range(10):
        publisher.publish(index, [1, 2, 3])
    close(control_dir)
    process = subprocess.Popen([sys.executable, "-c", TRAINER, str(control_dir)], env={**os.environ, **master.env()},
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    reported = []
    try:
        for _ in range(3):
            process.stdin.write("ack\n")
            process.stdin.flush()
            reported.append(read_line(process))
        # Killed on the fourth sample, before acknowledging it.
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=WAIT_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()

    trained = acknowledged(control_dir)
    assert trained == set(reported)
    restarted = [sample["sample_id"] for sample in HiddenStatesStream(control_dir, store_env=master.env())]
    assert sorted([*trained, *restarted]) == sorted(publisher.published)
    assert not any(publisher.in_store(sample_id) for sample_id in trained)
    assert all(publisher.in_store(sample_id) for sample_id in restarted)


KILLED = 17  # the exit status of a trainer killed at its kill point
KILL_POINTS = {  # where in its last acknowledgement (two samples, five objects each), and the objects it leaves
    "before the log line": 10,
    "between the log line and the removes": 10,
    "between two removes": 9,
}
# A trainer that reads every sample, acknowledges them one by one but the last two, and is
# killed (os._exit: nothing of its own runs after it) at argv[2] of acknowledging those two.
KILLED_TRAINER = textwrap.dedent(f"""
    import os
    import sys
    from scripts.online import stream as online

    kill_at = None
    removes = 0
    append, remove = online.AckLog.append, online.StoreReader.remove

    def append_killed(self, sample_ids):
        if kill_at == "before the log line":
            os._exit({KILLED})
        append(self, sample_ids)
        if kill_at == "between the log line and the removes":
            os._exit({KILLED})

    def remove_killed(self, key):
        global removes
        if kill_at == "between two removes" and removes == 1:
            os._exit({KILLED})
        removes += kill_at is not None
        remove(self, key)

    online.AckLog.append, online.StoreReader.remove = append_killed, remove_killed
    stream = online.HiddenStatesStream(sys.argv[1])
    sample_ids = [sample["sample_id"] for sample in stream]
    for sample_id in sample_ids[:-2]:
        stream.ack([sample_id])
    kill_at = sys.argv[2]
    stream.ack(sample_ids[-2:])
""")


def kill_a_trainer_mid_ack(control_dir, store: MooncakeMaster, kill_at: str) -> None:
    trainer = subprocess.run([sys.executable, "-c", KILLED_TRAINER, str(control_dir), kill_at],
                             env={**os.environ, **store.env()}, timeout=WAIT_TIMEOUT_S)
    assert trainer.returncode == KILLED


def train_on_every_sample(control_dir, store: MooncakeMaster) -> List[str]:
    stream = HiddenStatesStream(control_dir, store_env=store.env())
    trained = []
    for sample in stream:
        stream.ack([sample["sample_id"]])
        trained.append(sample["sample_id"])
    return trained


@pytest.mark.parametrize("kill_at", KILL_POINTS)
def test_a_trainer_killed_mid_ack_and_restarted_leaves_the_store_empty(control_dir, kill_at):
    """Counted by the store's master, not by the stream: a store of its own."""
    with MooncakeMaster(segment_size=STORE_MEMORY) as store:
        publisher = Publisher(control_dir, store.env(), "specforge", "a")
        every_sample = {publisher.publish(index, [1, 2, 3]) for index in range(4)}
        close(control_dir)
        kill_a_trainer_mid_ack(control_dir, store, kill_at)
        assert store.key_count() == KILL_POINTS[kill_at]  # hard-pinned: left until someone removes them

        retrained = train_on_every_sample(control_dir, store)
        assert len(retrained) == (2 if kill_at == "before the log line" else 0)
        assert acknowledged(control_dir) == every_sample
        assert store.key_count() == 0


def four_samples_and_a_trainer_killed_mid_ack(control_dir, store):
    """Four samples published and closed, then a trainer killed between the acknowledgement's
    log line and its removes; the publisher, for later samples."""
    publisher = Publisher(control_dir, store.env(), "specforge", "a")
    for index in range(4):
        publisher.publish(index, [1, 2, 3])
    close(control_dir)
    kill_a_trainer_mid_ack(control_dir, store, "between the log line and the removes")
    return publisher


def test_a_restarted_trainer_removes_what_a_kill_left_at_its_first_ack(control_dir):
    """Without iterating: a trainer restarted after its last sample was acknowledged may
    only acknowledge samples published since."""
    with MooncakeMaster(segment_size=STORE_MEMORY) as store:
        publisher = four_samples_and_a_trainer_killed_mid_ack(control_dir, store)
        late = publisher.publish(4, [1, 2, 3])
        assert store.key_count() == 15

        HiddenStatesStream(control_dir, store_env=store.env()).ack([late])
        assert store.key_count() == 0


def test_without_removing_what_a_kill_left_the_store_keeps_it(control_dir, monkeypatch):
    """The negative control of the two tests above: a restart that skips acknowledged samples
    and removes nothing of theirs leaves their objects in the store for good."""
    monkeypatch.setattr(stream_module, "acknowledged_unremoved", lambda state_dir: set())
    monkeypatch.setattr(AckLog, "unremoved", lambda self: [])
    with MooncakeMaster(segment_size=STORE_MEMORY) as store:
        four_samples_and_a_trainer_killed_mid_ack(control_dir, store)

        assert train_on_every_sample(control_dir, store) == []
        assert store.key_count() == 10


def test_an_ack_log_line_a_killed_trainer_left_unfinished_is_no_ack(tmp_path):
    log = AckLog(tmp_path, rank=0)
    log.append(["s1"])
    with open(log.path, "a") as unfinished:
        unfinished.write('{"sample_id": "s2')
    assert acknowledged(tmp_path) == {"s1"}

    AckLog(tmp_path, rank=0).append(["s3"])  # a restarted trainer's
    assert acknowledged(tmp_path) == {"s1", "s3"}


def test_the_stream_waits_for_new_lines_until_the_closed_marker(master, control_dir):
    publisher = Publisher(control_dir, master.env(), "hs-connectors", "a")
    first = publisher.publish(0, [1, 2, 3])
    samples = iter(HiddenStatesStream(control_dir, store_env=master.env()))
    assert next(samples)["sample_id"] == first

    second = publisher.publish(1, [1, 2, 3])  # while the stream waits
    assert next(samples)["sample_id"] == second
    close(control_dir)
    assert next(samples, None) is None


def test_without_the_closed_marker_an_idle_stream_times_out(master, control_dir):
    publisher = Publisher(control_dir, master.env(), "hs-connectors", "a")
    first = publisher.publish(0, [1, 2, 3])
    samples = iter(HiddenStatesStream(control_dir, store_env=master.env(), idle_timeout_s=0.2))
    assert next(samples)["sample_id"] == first
    with pytest.raises(TimeoutError, match=CLOSED_MARKER):
        next(samples)


@pytest.mark.parametrize("line,complaint", [
    ({"rid": "rid-of-a-file", "file": "x.safetensors", "num_tokens": 1}, "not the Mooncake sink's"),
    ({"rid": "rid-of-a-layout", "sink": "mooncake", "layout": "lmcache", "sample_id": "s"}, "layout 'lmcache'"),
])
def test_a_manifest_line_the_stream_cannot_read_is_refused_naming_its_rid(control_dir, line, complaint):
    (control_dir / "manifest.jsonl").write_text(json.dumps(line) + "\n")
    close(control_dir)
    with pytest.raises(ValueError, match=complaint) as refused:
        list(HiddenStatesStream(control_dir, store_env={}))
    assert line["rid"] in str(refused.value)


def test_a_store_it_cannot_join_is_an_error_naming_the_master(master, control_dir, monkeypatch):
    monkeypatch.setenv("MC_STORE_CLIENT_SETUP_RETRIES", "1")  # not 20 tries of 4.5 s each
    publisher = Publisher(control_dir, master.env(), "specforge", "a")
    publisher.publish(0, [1, 2, 3])
    close(control_dir)
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{unused.getsockname()[1]}"
    with pytest.raises(ConnectionError, match=nowhere):
        list(HiddenStatesStream(control_dir, store_env={**master.env(), "MOONCAKE_MASTER_SERVER_ADDR": nowhere}))


def test_a_worker_forked_from_a_process_holding_a_client_says_how_to_start_workers(master, control_dir):
    publisher = Publisher(control_dir, master.env(), "specforge", "a")
    publisher.publish(0, [1, 2, 3])
    close(control_dir)
    stream = HiddenStatesStream(control_dir, store_env=master.env())
    assert len(list(stream)) == 1  # this process now holds the stream's client

    forked = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=1, multiprocessing_context="fork")
    with pytest.raises(RuntimeError, match="multiprocessing_context='spawn'"):
        list(forked)


@pytest.mark.parametrize("layout", ["specforge", "hs-connectors"])
def test_an_object_overwritten_under_its_key_is_refused_by_name(master, control_dir, layout):
    publisher = Publisher(control_dir, master.env(), layout, "a")
    untouched = publisher.publish(0, [1, 2, 3])
    overwritten = publisher.publish(1, [1, 2, 3])
    publisher.overwrite(overwritten, "someone-else")
    close(control_dir)
    stream = iter(HiddenStatesStream(control_dir, store_env=master.env()))
    assert next(stream)["sample_id"] == untouched  # the negative control: read and checked
    with pytest.raises(ChecksumMismatch, match=f"rid-{overwritten}"):
        next(stream)


def test_samples_flagged_nonfinite_are_skipped_unless_kept_and_lines_without_checksums_read(master, control_dir):
    publisher = Publisher(control_dir, master.env(), "specforge", "a")
    clean = publisher.publish(0, [1, 2, 3])
    flagged = publisher.publish(1, [1, 2, 3], nonfinite_rows=2)
    unchecked = publisher.publish(2, [1, 2, 3], checksums=False)  # written before checksums
    close(control_dir)
    stream = HiddenStatesStream(control_dir, store_env=master.env())
    assert [sample["sample_id"] for sample in stream] == [clean, unchecked]
    assert stream.skipped_nonfinite == [flagged]
    kept = HiddenStatesStream(control_dir, store_env=master.env(), keep_nonfinite=True)
    assert [sample["sample_id"] for sample in kept] == [clean, flagged, unchecked]


@pytest.mark.parametrize("keep_nonfinite", [False, True])
def test_a_skipped_sample_is_removed_with_the_next_ack_not_left_pinned(control_dir, keep_nonfinite):
    """Counted by the store's master: a skipped sample is never acknowledged by the trainer, so
    the stream's ack removes it; kept (the control), it is the trainer's to acknowledge."""
    with MooncakeMaster(segment_size=STORE_MEMORY) as store:
        publisher = Publisher(control_dir, store.env(), "specforge", "a")
        publisher.publish(0, [1, 2, 3])
        flagged = publisher.publish(1, [1, 2, 3], nonfinite_rows=1)
        publisher.publish(2, [1, 2, 3])
        close(control_dir)
        stream = HiddenStatesStream(control_dir, store_env=store.env(), keep_nonfinite=keep_nonfinite)
        trained = [sample["sample_id"] for sample in stream if sample["sample_id"] != flagged]
        stream.ack(trained)
        if keep_nonfinite:
            assert flagged not in acknowledged(control_dir)
            assert store.key_count() > 0
            stream.ack([flagged])
        else:
            assert flagged in acknowledged(control_dir)
        assert store.key_count() == 0
        assert list(HiddenStatesStream(control_dir, store_env=store.env())) == []
