"""The Mooncake sink against a real mooncake_master over TCP: what it puts equals what the
file sink writes, bit for bit, and the trainers' own readers read it (SpecForge's
MooncakeFeatureStore and StreamingRefChannel, hs-connectors' get_sample); a full store is
waited out and nothing is evicted; no store, a clear error at startup."""

import os
import time
from unittest import mock

import pytest
import torch

from sglang.srt.hidden_states_dump.config import DumpConfig, MooncakeSettings
from sglang.srt.hidden_states_dump.format import checksum_of, load_dump, read_manifest
from sglang.srt.hidden_states_dump.requests import DumpRequest, finish_dumped_requests
from sglang.srt.hidden_states_dump.store_layouts import REF_CHANNEL
from tests.unit.dump_standins import (
    SchedulerReq,
    bits,
    next_output_reports,
    prompt,
    run_forward,
    start_dumper,
    stats,
    wait_for_manifest,
    wait_for_stats,
)

pytestmark = pytest.mark.same_on_every_release

mooncake_store = pytest.importorskip("mooncake.store")
from scripts.online.master import MooncakeMaster  # noqa: E402

LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    with MooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log", segment_size=256 << 20) as running:
        yield running


@pytest.fixture
def small_master(tmp_path):
    """A store of 32 MiB, which a few samples fill."""
    with MooncakeMaster(tmp_path / "small-master.log", segment_size=32 << 20) as running:
        yield running


@pytest.fixture
def store_env(master, monkeypatch):
    """The server's environment for the Mooncake sink, as its processes see it."""

    def set_env(layout, store=master, **extra):
        for name, value in {**store.env(), "SGLANG_HS_DUMP_SINK": "mooncake",
                            "SGLANG_HS_DUMP_SINK_LAYOUT": layout, "MOONCAKE_LOCAL_BUFFER_SIZE": "64MB",
                            **extra}.items():
            monkeypatch.setenv(name, value)

    return set_env


def client(master):
    """A trainer's Mooncake client, lending the store no memory."""
    store = mooncake_store.MooncakeDistributedStore()
    env = master.env()
    assert store.setup(env["MOONCAKE_LOCAL_HOSTNAME"], env["MOONCAKE_METADATA_SERVER"], 0, 64 << 20, "tcp", "",
                       env["MOONCAKE_MASTER_SERVER_ADDR"]) == 0
    return store


def feed(dumper):
    """Two requests, one of them prefilled in two chunks; the first with a loss mask. Returns
    where each request's last output says its sample is."""
    reqs = {rid: SchedulerReq(rid) for rid in ("a", "b")}
    run_forward(dumper, [(DumpRequest("a", 5, (2, 3), reqs["a"]), prompt(100, 5), 0),
                         (DumpRequest("b", 7, None, reqs["b"]), prompt(200, 4), 0)])
    run_forward(dumper, [(DumpRequest("b", 7, None, reqs["b"]), prompt(204, 3), 4)])
    finish_dumped_requests([req.finish() for req in reqs.values()])
    reported = {}
    for rid, req in reqs.items():
        [reported[rid]] = next_output_reports(req)
    return reported


def file_dump(tmp_path, dtype=None):
    """The same requests through the file sink; each response names its file."""
    files_dir = tmp_path / "files"
    files_dir.mkdir()
    dumper = start_dumper(files_dir, LAYERS, dtype=dtype)
    reported = feed(dumper)
    lines = wait_for_manifest(files_dir, ["a", "b"])
    for line in lines:
        assert reported[line["rid"]] == {"sink": "files", "manifest": "manifest.jsonl", "file": line["file"]}
    return {line["rid"]: load_dump(os.path.join(files_dir, line["file"]), raw=True) for line in lines}


def test_specforge_layout_equals_the_file_sink_and_specforge_reads_it(tmp_path, master, store_env):
    from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore
    from specforge.runtime.data_plane.streaming_ref_channel import StreamingRefChannel

    expected = file_dump(tmp_path)
    store_env("specforge", SGLANG_HS_DUMP_STORE_ID="unit-specforge")
    control = tmp_path / "control"
    control.mkdir()
    dumper = start_dumper(control, LAYERS)
    reported = feed(dumper)
    wait_for_stats(dumper, lambda counters: counters["files"] == 2)
    lines = {line["rid"]: line for line in read_manifest(str(control))}
    assert sorted(os.listdir(control)) == ["manifest.jsonl", REF_CHANNEL]  # no rows on disk
    for rid, line in lines.items():  # each response: SpecForge's spec_capture fields and the keys
        assert reported[rid] == {
            "sink": "mooncake", "layout": "specforge", "store_id": "unit-specforge", "sample_id": line["sample_id"],
            "gen": 1, "aux_layer_ids": LAYERS,
            "features": {name: {"shape": spec["shape"], "dtype": spec["dtype"]} for name, spec in line["objects"].items()},
            "keys": {name: spec["key"] for name, spec in line["objects"].items()},
        }

    refs = StreamingRefChannel(str(control / REF_CHANNEL)).poll()
    assert [ref.source_task_id for ref in refs] == ["a", "b"]
    env = master.env()
    features = MooncakeFeatureStore(store_id="unit-specforge", setup_kwargs=dict(
        local_hostname=env["MOONCAKE_LOCAL_HOSTNAME"], metadata_server=env["MOONCAKE_METADATA_SERVER"],
        master_server_addr=env["MOONCAKE_MASTER_SERVER_ADDR"], global_segment_size=0, local_buffer_size=64 << 20))
    for ref in refs:
        rid = ref.source_task_id
        record = expected[rid]
        tensors, _ = features.get(ref)
        num_tokens = record.token_ids.numel()
        assert lines[rid]["sample_id"] == ref.sample_id and lines[rid]["num_tokens"] == num_tokens
        assert torch.equal(tensors["input_ids"], record.token_ids[None])
        assert torch.equal(tensors["hidden_state"], record.hidden_states.reshape(1, num_tokens, -1))
        assert torch.equal(tensors["target"], record.last_hidden_state[None])
        assert torch.equal(tensors["attention_mask"], torch.ones(1, num_tokens, dtype=torch.int64))
        mask = [0, 0, 1, 1, 1] if rid == "a" else [1] * 7
        assert tensors["loss_mask"].tolist() == [mask]
        for name, spec in lines[rid]["objects"].items():  # each object's checksum, of what SpecForge reads
            assert spec["checksum"] == checksum_of([tensors[name].contiguous().view(-1).view(torch.uint8).numpy()]), name


@pytest.mark.parametrize("dtype", [None, "fp8"])
def test_hs_connectors_layout_equals_the_file_sink_and_get_sample_reads_it(tmp_path, master, store_env, dtype):
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

    expected = file_dump(tmp_path, dtype)
    store_env("hs-connectors")
    control = tmp_path / "control"
    control.mkdir()
    dumper = start_dumper(control, LAYERS, dtype=dtype)
    reported = feed(dumper)
    wait_for_stats(dumper, lambda counters: counters["files"] == 2)
    for line in read_manifest(str(control)):  # each response: the transfer manifest, before its checksums
        manifest = line["transfer_manifest"]
        assert reported[line["rid"]]["transfer_manifest"] == dict(
            manifest, metadata={k: v for k, v in manifest["metadata"].items() if k != "checksum"},
            tensors={name: {k: v for k, v in spec.items() if k != "checksum"} for name, spec in manifest["tensors"].items()})
        assert reported[line["rid"]]["sample_id"] == line["sample_id"]
        assert line["checksum"] == manifest["metadata"]["checksum"]
    env = master.env()
    reader = MooncakeHiddenStatesStore(MooncakeStoreConfig(
        local_hostname=env["MOONCAKE_LOCAL_HOSTNAME"], metadata_server=env["MOONCAKE_METADATA_SERVER"],
        master_server_address=env["MOONCAKE_MASTER_SERVER_ADDR"], global_segment_size=0,
        local_buffer_size=64 << 20)).setup()
    names = ["token_ids", "hidden_states", "last_hidden_state"]
    names += ["hidden_states_scale", "last_hidden_state_scale"] if dtype else []
    for line in read_manifest(str(control)):
        assert line["sink"] == "mooncake" and "file" not in line
        sample = reader.get_sample(line["transfer_manifest"], timeout=10)
        record = expected[line["rid"]]
        for name in names:
            assert torch.equal(bits(sample[name]), bits(getattr(record, name))), name
        mask = [0, 0, 1, 1, 1] if line["rid"] == "a" else [1] * 7
        assert sample["loss_mask"].tolist() == mask
        for name, spec in line["transfer_manifest"]["tensors"].items():  # each tensor's checksum, of what is read
            assert spec["checksum"] == checksum_of([sample[name].contiguous().view(-1).view(torch.uint8).numpy()]), name
        # The packed object's, of its bytes as stored (padding included).
        packed = reader._read_from_store(line["transfer_manifest"]["handle"])
        assert line["checksum"] == checksum_of([packed.numpy()])
        reader.delete_sample(line["transfer_manifest"]["handle"])


def test_a_full_store_is_waited_out_and_nothing_is_evicted(tmp_path, small_master, store_env):
    """Objects hard-pinned: with the store full the writer waits (block); once the trainer
    removes what it read, every sample lands, none lost."""
    store_env("hs-connectors", store=small_master)
    control = tmp_path / "control"
    control.mkdir()
    dumper = start_dumper(control, LAYERS, reserve_bytes=128 << 20)
    # About 1.4 MB a sample: a few dozen fill the store.
    rids = [f"big{i}" for i in range(100)]
    for i, rid in enumerate(rids):
        run_forward(dumper, [(DumpRequest(rid, 20_000), prompt(10_000 + 20_000 * i, 20_000), 0)])
        if stats(dumper)["store_full"]:
            break
    assert stats(dumper)["store_full"], "100 samples of 1.4 MB fit a 32 MiB store"
    # Nothing else lands while the store is full.
    waited = wait_for_stats(dumper, lambda counters: counters["files"] + counters["store_full"] == i + 1)
    published = read_manifest(str(control))
    assert waited["files"] == len(published) < i + 1  # the rest wait for room
    reader = client(small_master)
    for line in published:  # nothing evicted while full: every published sample is whole
        assert reader.get_size(line["transfer_manifest"]["handle"]) == line["bytes"]
    for line in published:
        assert reader.remove(line["transfer_manifest"]["handle"], force=True) == 0
    done = wait_for_stats(dumper, lambda counters: counters["files"] == i + 1)
    assert done["dropped"] == done["errors"] == 0
    lines = read_manifest(str(control))
    assert [line["rid"] for line in lines] == rids[: i + 1]
    for line in lines[len(published):]:
        assert reader.get_size(line["transfer_manifest"]["handle"]) == line["bytes"]
        reader.remove(line["transfer_manifest"]["handle"], force=True)


def test_a_restarted_writer_never_reuses_a_key(tmp_path, master, store_env):
    """Keys come from the writer's run, never from request ids: a writer started again on the
    same directory, given the same rids, publishes new samples beside the old ones."""
    store_env("hs-connectors")
    control = tmp_path / "control"
    control.mkdir()
    for _ in range(2):
        dumper = start_dumper(control, LAYERS)
        feed(dumper)
        wait_for_stats(dumper, lambda counters: counters["files"] == 2)
    lines = read_manifest(str(control))
    handles = [line["transfer_manifest"]["handle"] for line in lines]
    assert [line["rid"] for line in lines] == ["a", "b", "a", "b"] and len(set(handles)) == 4
    reader = client(master)
    for line, handle in zip(lines, handles):
        assert reader.get_size(handle) == line["bytes"]  # the first run's samples are still whole
        reader.remove(handle, force=True)


def test_a_ref_a_kill_left_out_is_published_when_the_writer_starts_again(tmp_path, master, store_env):
    """The writer appends a sample's manifest line, then its ref: killed between the two (or
    while writing the ref), the sample is listed, so a rerun never dumps it again, while
    SpecForge's trainer, which reads the channel, would never see it. A writer starting on the
    manifest publishes the missing ref, rebuilt from the line, and cuts the torn one."""
    from specforge.runtime.data_plane.streaming_ref_channel import StreamingRefChannel

    store_env("specforge", SGLANG_HS_DUMP_STORE_ID="unit-refs")
    control = tmp_path / "control"
    control.mkdir()
    dumper = start_dumper(control, LAYERS)
    feed(dumper)
    wait_for_stats(dumper, lambda counters: counters["files"] == 2)
    channel = control / REF_CHANNEL
    first, second = channel.read_text().splitlines()
    assert [line["rid"] for line in read_manifest(str(control))] == ["a", "b"]
    # What such a kill leaves: b listed, its ref half written.
    channel.write_text(first + "\n" + second[: len(second) // 2])
    start_dumper(control, LAYERS)  # a writer started again on the same directory
    assert channel.read_text() == first + "\n" + second + "\n"  # the ref rebuilt bit for bit
    assert [ref.source_task_id for ref in StreamingRefChannel(str(channel)).poll()] == ["a", "b"]
    # The negative control: with no ref missing, a writer starting again publishes none.
    start_dumper(control, LAYERS)
    assert channel.read_text() == first + "\n" + second + "\n"
    reader = client(master)
    for line in read_manifest(str(control)):
        for spec in line["objects"].values():
            reader.remove(spec["key"], force=True)


def memory_holding(store, key: str) -> str:
    """The endpoint of the store memory that holds `key`."""
    return store.get_replica_desc(key)[0].get_memory_descriptor().buffer_descriptor.transport_endpoint


def test_a_writer_that_lends_the_store_memory_holds_its_own_samples(tmp_path, master, store_env):
    """With MOONCAKE_GLOBAL_SEGMENT_SIZE set, the writer's samples go into the memory it lends
    (a copy on its host, not a transfer), none into the store's other memory. The control: a
    client lending memory that puts without the preference finds its objects spread over the
    memories the store has."""
    reader = client(master)
    assert reader.put("unit-lent/probe", bytes(1024)) == 0  # a client lending nothing: the store's memory
    store_memory = memory_holding(reader, "unit-lent/probe")
    reader.remove("unit-lent/probe", force=True)

    store_env("hs-connectors", MOONCAKE_GLOBAL_SEGMENT_SIZE="64MB")
    control = tmp_path / "control"
    control.mkdir()
    dumper = start_dumper(control, LAYERS)
    for _ in range(4):
        feed(dumper)
    wait_for_stats(dumper, lambda counters: counters["files"] == 8)
    handles = [line["transfer_manifest"]["handle"] for line in read_manifest(str(control))]
    holders = {memory_holding(reader, handle) for handle in handles}
    assert len(holders) == 1 and store_memory not in holders, (holders, store_memory)

    lender = mooncake_store.MooncakeDistributedStore()
    env = master.env()
    assert lender.setup(env["MOONCAKE_LOCAL_HOSTNAME"], env["MOONCAKE_METADATA_SERVER"], 64 << 20, 16 << 20, "tcp",
                        "", env["MOONCAKE_MASTER_SERVER_ADDR"]) == 0
    config = mooncake_store.ReplicateConfig()
    config.replica_num = 1
    config.with_hard_pin = True
    keys = [f"unit-lent/unpreferred-{i}" for i in range(24)]
    assert all(lender.put(key, bytes(64 << 10), config) == 0 for key in keys)
    spread = {memory_holding(reader, key) for key in keys}  # the lender's, the store's, the writer's
    assert len(spread) > 1 and store_memory in spread, spread
    for key in keys + handles:
        reader.remove(key, force=True)


def test_unpinned_objects_are_evicted_when_the_store_fills(small_master):
    """The negative control: what a put without a hard pin (hs-connectors' own default)
    risks. Filling the store with unpinned objects loses some of them, silently, within
    about a second of the first put the store refuses."""
    store = client(small_master)
    config = mooncake_store.ReplicateConfig()
    config.replica_num = 1
    data = bytes(2 << 20)
    keys = [f"unit-unpinned/{i}" for i in range(40)]
    # 80 MiB into 32: some puts are refused, or (the store evicting as it goes) all succeed
    # and older ones go; either way some of those stored are lost.
    stored = [key for key in keys if store.put(key, data, config) == 0]
    deadline = time.monotonic() + 10
    while not (lost := [key for key in stored if store.get_size(key) < 0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost, f"{len(stored)} unpinned objects filled the store, none evicted within 10 s"


def test_no_store_is_a_clear_error_at_startup(tmp_path, store_env):
    store_env("specforge", MOONCAKE_MASTER_SERVER_ADDR="127.0.0.1:9")  # nothing listens there
    control = tmp_path / "control"
    control.mkdir()
    with pytest.raises(ValueError, match=r"cannot connect to the Mooncake store \(MOONCAKE_MASTER_SERVER_ADDR=127.0.0.1:9"):
        start_dumper(control, LAYERS)
    assert os.listdir(control) == []


@pytest.mark.parametrize("name,value,message", [
    ("MOONCAKE_MASTER_SERVER_ADDR", "localhost", "give the master's host:port"),
    ("MOONCAKE_PROTOCOL", "udp", "use one of tcp, rdma"),
    ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "lots", "give a size in bytes"),
    ("MOONCAKE_METADATA_SERVER", "metadata", "give P2PHANDSHAKE or a URL"),
])
def test_each_bad_mooncake_setting_is_refused_by_name(name, value, message):
    with pytest.raises(ValueError, match=f"{name}=.*{message}"):
        MooncakeSettings.from_env({name: value})


def test_layouts_refuse_what_they_cannot_hold(tmp_path):
    base = {"SGLANG_HS_DUMP_DIR": str(tmp_path), "SGLANG_HS_DUMP_SINK": "mooncake"}
    with mock.patch.dict(os.environ, {**base, "SGLANG_HS_DUMP_DTYPE": "fp8"}):
        with pytest.raises(ValueError, match="SpecForge's layout has no place for fp8 scales"):
            DumpConfig.from_env()
    with mock.patch.dict(os.environ, {**base, "SGLANG_HS_DUMP_SINK_LAYOUT": "vllm"}):
        with pytest.raises(ValueError, match="SGLANG_HS_DUMP_SINK_LAYOUT='vllm'"):
            DumpConfig.from_env()
    with mock.patch.dict(os.environ, {**base, "SGLANG_HS_DUMP_SINK": "s3"}):
        with pytest.raises(ValueError, match="SGLANG_HS_DUMP_SINK='s3'"):
            DumpConfig.from_env()
    with mock.patch.dict(os.environ, {**base, "SGLANG_HS_DUMP_WRITER_PROCESS": "0"}):
        with pytest.raises(ValueError, match="puts from the writer process"):
            DumpConfig.from_env()
