"""scripts.dumps.generate on real CPU servers dumping into one directory: two servers, each
under its own writer id, one SIGKILLed mid-run, the run finishes on the other; a rerun with
both sends nothing again; each server's manifest lists only the files its writer wrote. One
server with two data-parallel replicas (--dp-size 2): each replica writes its own manifest."""

import json
import shutil
from contextlib import ExitStack
from pathlib import Path

import pytest

from scripts.dump_format import load_dump, manifest_name
from scripts.dumps.samples import SAMPLES_NAME, read_lines
from scripts.dumps.server import Server, runtime_env
from tests.server.fault_hooks import stall_writer_spec
from tests.server.test_generate import (DUMP_LAYERS, MAX_LENGTH, check_complete, run_generate, start_generate,
                                        wait_while_running, write_dataset)


def dumping_server(model: Path, out: Path, writer_id: str, log_name: str, extra_args=(), **env: str) -> Server:
    return Server(model, out.with_name(log_name), runtime_env(SGLANG_HS_DUMP_DIR=str(out), SGLANG_HS_DUMP_LAYERS=DUMP_LAYERS,
                                                              SGLANG_HS_DUMP_WRITER_ID=writer_id, **env), list(extra_args))


def manifest_files(out: Path, writer_id: str, dp_rank: int = 0) -> list:
    """The files one writer's manifest lists (a torn last line, left by a kill, is none)."""
    files = []
    for line in (out / manifest_name(dp_rank, writer_id)).read_bytes().splitlines():
        try:
            files.append(json.loads(line)["file"])
        except ValueError:
            pass
    return files


def wait_for_lines(path: Path, count: int, process) -> None:
    wait_while_running(process, lambda: path.exists() and len(path.read_bytes().splitlines()) >= count,
                       f"{path}: fewer than {count} lines")


def test_a_killed_server_hands_its_samples_to_the_other(model_l3, tmp_path):
    path = tmp_path / "chats.jsonl"
    valid, bad = write_dataset(path)
    out = tmp_path / "dump"
    options = ["--dataset", path, "--out", out, "--max-length", MAX_LENGTH, "--model", model_l3,
               "--concurrency", 1, "--retries", 1]

    # Server "a" writes two files, then its disk stalls and it answers nothing more: the
    # sample its writer holds waits for a manifest line that never comes, so the run cannot
    # end before "a" is killed, and the samples "a" holds or would have taken go to "b".
    # (Stalling only the writer is not enough: "a"'s queue would take every sample while a
    # slow "b" answers its first, and the run would end on the manifest timeout instead.)
    gate = tmp_path / "stall-a"
    gate.touch()
    with ExitStack() as stack:
        server_a = stack.enter_context(dumping_server(model_l3, out, "a", "server-a.log",
                                                      ["--forward-hooks", stall_writer_spec(gate, after=2, hold_answers=True)]))
        server_b = stack.enter_context(dumping_server(model_l3, out, "b", "server-b.log"))
        server_a.wait_ready()
        server_b.wait_ready()
        url_a, url_b = server_a.url, server_b.url

        command = start_generate(*options, "--server", url_a, "--server", url_b)
        wait_for_lines(out / manifest_name(0, "a"), 2, command)  # both servers take samples
        wait_for_lines(out / manifest_name(0, "b"), 2, command)
        holding = gate.with_name(gate.name + ".holding")  # "a" has answered a sample its stalled writer holds
        wait_while_running(command, holding.exists, "server a's writer never took a third job")
        server_a.kill()
        output, _ = command.communicate(timeout=300)
        assert command.returncode == 0, output
        check_complete(out, valid, bad)
        assert f"{url_a} dropped" in output
        summary = output[output.index("dumped "):]
        assert f"  {url_a}: " in summary and "; dropped: not answered by" in summary
        assert f"  {url_b}: " in summary
        dumped_before = len(read_lines(out / SAMPLES_NAME))

        server_a = stack.enter_context(dumping_server(model_l3, out, "a", "server-a2.log"))
        server_a.wait_ready()
        result = run_generate(*options, "--server", server_a.url, "--server", url_b)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"skipped as done: {len(valid)}" in result.stdout
        assert f"  {server_a.url}: 0 samples" in result.stdout and f"  {url_b}: 0 samples" in result.stdout
        assert len(read_lines(out / SAMPLES_NAME)) == dumped_before
        check_complete(out, valid, bad)

    files_a, files_b = manifest_files(out, "a"), manifest_files(out, "b")
    assert files_a and files_b and not set(files_a) & set(files_b)
    assert not (out / "manifest.jsonl").exists()
    rids = {entry["rid"] for entry in map(json.loads, (out / SAMPLES_NAME).read_text().splitlines())}
    for file in files_a + files_b:
        assert load_dump(str(out / file)).metadata["rid"] in rids


def test_each_data_parallel_replica_dumps_under_its_own_manifest(model_l3, tmp_path):
    path = tmp_path / "chats.jsonl"
    valid, bad = write_dataset(path, conversations=16)  # fewer: this server takes long to start
    out = tmp_path / "dump"
    # SGLang's CPU path refuses more ranks than NUMA nodes unless each rank is given its
    # cores: one core each.
    with dumping_server(model_l3, out, "a", "server.log", ["--dp-size", "2"], SGLANG_CPU_OMP_THREADS_BIND="0|1") as server:
        server.wait_ready()
        result = run_generate("--dataset", path, "--out", out, "--max-length", MAX_LENGTH, "--model", model_l3,
                              "--server", server.url, "--concurrency", 2)
    assert result.returncode == 0, result.stdout + result.stderr
    check_complete(out, valid, bad)
    assert sorted(p.name for p in out.glob("manifest*")) == [manifest_name(1, "a"), manifest_name(0, "a")]
    files_0, files_1 = manifest_files(out, "a"), manifest_files(out, "a", dp_rank=1)
    assert files_0 and files_1 and not set(files_0) & set(files_1)  # the controller hands both replicas samples
    samples = {line["rid"]: line for line in read_lines(out / SAMPLES_NAME)}
    for file in files_0 + files_1:
        record = load_dump(str(out / file))
        assert record.token_ids.shape[0] == samples[record.metadata["rid"]]["num_tokens"]

    # Negative controls: the check reads both replicas' manifests as one, so a dump without
    # the second replica's lacks samples, and one that lists its files twice has duplicates.
    without_dp1 = tmp_path / "without-dp1"
    shutil.copytree(out, without_dp1)
    (without_dp1 / manifest_name(1, "a")).unlink()
    with pytest.raises(AssertionError):
        check_complete(without_dp1, valid, bad)
    dp1_twice = tmp_path / "dp1-twice"
    shutil.copytree(out, dp1_twice)
    with open(dp1_twice / manifest_name(0, "a"), "ab") as manifest:
        manifest.write((out / manifest_name(1, "a")).read_bytes())
    with pytest.raises(AssertionError):
        check_complete(dp1_twice, valid, bad)
