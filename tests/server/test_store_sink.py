"""The Mooncake sink on real CPU servers and a real mooncake_master over TCP, driven by
`generate --sink mooncake`: the rows never touch the disk; HiddenStatesStream and
SpecForge's own consumer (its StreamingRefChannel and MooncakeFeatureStore) read every sample
back equal, bit for bit, to the file sink's dump of the same conversations; generate
SIGKILLed mid-run (its server dies with it) and rerun, then two servers and two trainer
ranks: every sample exactly once."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from scripts.dump_format import load_dump, read_manifest
from scripts.dumps.samples import SAMPLES_NAME, mask_from_runs, read_lines
from scripts.dumps.server import Server, runtime_env
from scripts.online.master import MooncakeMaster
from scripts.online.stream import CLOSED_MARKER, HiddenStatesStream
from scripts.paths import REPO_ROOT
from tests.server.test_generate import MAX_LENGTH, dumping_processes, write_dataset

DEFAULT_STORE_ID = "sglang-hs"  # SGLANG_HS_DUMP_STORE_ID's default: the first part of every key
LAYERS = "0,1,2"  # below L = 3, ascending: what SpecForge's layout holds (it refuses layer L)
CONVERSATIONS = 14


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    with MooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log", segment_size=512 << 20) as running:
        yield running


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    valid, _ = write_dataset(path, conversations=CONVERSATIONS)
    return path, valid


def generate(*args, env=None, wait=True):
    command = [sys.executable, "-m", "scripts.dumps.generate", *map(str, args)]
    if wait:
        return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)


@pytest.fixture(scope="module")
def file_dump(model_l3, conversations, tmp_path_factory):
    """The conversations dumped to files, one request at a time (so that every server given
    them computes the same values)."""
    path, valid = conversations
    out = tmp_path_factory.mktemp("files") / "dump"
    done = generate("--dataset", path, "--out", out, "--model", model_l3, "--dump-layers", LAYERS,
                    "--concurrency", 1, "--max-length", MAX_LENGTH)
    assert done.returncode == 0, done.stdout + done.stderr
    records = {entry["rid"]: load_dump(str(out / entry["file"])) for entry in read_manifest(str(out))}
    masks = {line["rid"]: mask_from_runs(line["loss_mask"]) for line in read_lines(out / SAMPLES_NAME)}
    assert sorted(records) == sorted(masks) and len(records) == len(valid)
    return records, masks


def store_env(master):
    return {**os.environ, **master.env()}


def assert_equal_to_files(sample, record, mask) -> None:
    num_tokens = record.token_ids.numel()
    assert torch.equal(sample["input_ids"], record.token_ids)
    assert sample["loss_mask"].tolist() == mask
    assert torch.equal(sample["hidden_state"], record.last_hidden_state[None])
    assert torch.equal(sample["aux_hidden_state"], record.hidden_states.reshape(1, num_tokens, -1))


def test_generate_into_the_store_killed_and_rerun_equals_the_file_dump(model_l3, conversations, file_dump,
                                                                       master, tmp_path):
    from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore
    from specforge.runtime.data_plane.streaming_ref_channel import StreamingRefChannel

    path, valid = conversations
    records, masks = file_dump
    control = tmp_path / "control"
    env = store_env(master)
    options = ["--dataset", path, "--out", control, "--model", model_l3, "--dump-layers", LAYERS,
               "--concurrency", 1, "--max-length", MAX_LENGTH, "--sink", "mooncake"]
    command = generate(*options, env=env, wait=False)
    deadline = time.monotonic() + 300
    while len(read_lines(control / SAMPLES_NAME)) < 4:
        assert command.poll() is None, command.stdout.read()
        assert time.monotonic() < deadline, "fewer than 4 samples after 300 s"
        time.sleep(0.05)
    command.send_signal(signal.SIGKILL)
    command.wait()
    while dumping_processes(control):  # its server dies with it
        assert time.monotonic() < deadline, "the server of a killed generate is still running"
        time.sleep(0.2)
    assert not (control / CLOSED_MARKER).exists()
    done = generate(*options, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (control / CLOSED_MARKER).exists()
    assert not [name for name in os.listdir(control) if name.endswith(".safetensors")]  # rows only in the store

    lines = read_manifest(str(control))
    assert sorted(line["rid"] for line in lines) == sorted(valid)  # each sample once
    stream = HiddenStatesStream(control, store_env=env, idle_timeout_s=60)
    rid_of = {line["sample_id"]: line["rid"] for line in lines}
    seen = []
    for sample in stream:
        rid = rid_of[sample["sample_id"]]
        assert_equal_to_files(sample, records[rid], masks[rid])
        seen.append(rid)
    assert sorted(seen) == sorted(valid)

    # SpecForge's own consumer reads the same samples through its channel.
    refs = StreamingRefChannel(str(control / "refs.jsonl")).poll()
    assert sorted(ref.source_task_id for ref in refs) == sorted(valid)
    settings = master.env()
    features = MooncakeFeatureStore(store_id=DEFAULT_STORE_ID, setup_kwargs=dict(
        local_hostname=settings["MOONCAKE_LOCAL_HOSTNAME"], metadata_server=settings["MOONCAKE_METADATA_SERVER"],
        master_server_addr=settings["MOONCAKE_MASTER_SERVER_ADDR"], global_segment_size=0,
        local_buffer_size=64 << 20))
    for ref in refs[:3]:
        tensors, _ = features.get(ref)
        record = records[ref.source_task_id]
        assert torch.equal(tensors["hidden_state"], record.hidden_states.reshape(1, record.token_ids.numel(), -1))
        assert torch.equal(tensors["target"], record.last_hidden_state[None])
    stream.ack(sample_id for sample_id in rid_of)
    assert list(HiddenStatesStream(control, store_env=env, idle_timeout_s=60)) == []
    # The file tools refuse a control directory, naming where its rows are.
    refused = subprocess.run([sys.executable, "-m", "scripts.dumps.inspect_dump", str(control)], cwd=REPO_ROOT,
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "are in a Mooncake store" in refused.stderr


def test_two_servers_and_two_trainer_ranks_see_every_sample_once(model_l3, conversations, master, tmp_path):
    path, valid = conversations
    control = tmp_path / "control"
    env = store_env(master)
    servers = [
        Server(model_l3, tmp_path / f"server-{name}.log",
               {**runtime_env(SGLANG_HS_DUMP_DIR=str(control), SGLANG_HS_DUMP_LAYERS=LAYERS,
                              SGLANG_HS_DUMP_SINK="mooncake", SGLANG_HS_DUMP_WRITER_ID=name), **master.env()})
        for name in ("node-a", "node-b")
    ]
    with servers[0], servers[1]:
        for server in servers:
            server.wait_ready()
        done = generate("--dataset", path, "--out", control, "--model", model_l3, "--concurrency", 1,
                        "--max-length", MAX_LENGTH, "--sink", "mooncake", *[f"--server=http://127.0.0.1:{server.port}" for server in servers],
                        env=env)
        assert done.returncode == 0, done.stdout + done.stderr
    lines = read_manifest(str(control))
    assert {line["sample_id"].split("-dp")[0] for line in lines} == {"node-a", "node-b"}  # both served
    rid_of = {line["sample_id"]: line["rid"] for line in lines}
    per_rank = [[rid_of[sample["sample_id"]] for sample in HiddenStatesStream(
        control, rank=rank, world_size=2, store_env=env, idle_timeout_s=60)] for rank in range(2)]
    assert per_rank[0] and per_rank[1]
    assert sorted(per_rank[0] + per_rank[1]) == sorted(valid)  # every sample once, across ranks
