"""Faults of the dump's disk and of the server, each while serving: the server keeps
serving (200s after the fault), the error is logged and counted, no partial file is
visible, and every manifest line names a complete file that loads
(scripts/inspect_dump.summarise). Hostile request ids never name a file."""

import json
import resource
import shutil
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from scripts.dump_format import MANIFEST_NAME, TEMP_PREFIX, read_manifest
from tests.server.dump_checks import RELEASE, dump_stats, generate_body, random_prompts, wait_until
from tests.server.fault_hooks import report_pid_spec
from scripts.dumps.inspect_dump import summarise
from scripts.dumps.server import Server, child_pids, runtime_env, wait_for_manifest


def assert_consistent(dump_dir: Path):
    """Every manifest line names a complete file that matches it; no partial file."""
    summary = summarise(dump_dir)
    assert summary.problems == []
    assert sorted(p.name for p in dump_dir.iterdir() if p.name.startswith(TEMP_PREFIX)) == []
    return summary


def rids(dump_dir: Path):
    return [e["rid"] for e in read_manifest(str(dump_dir))]


def serve(server, rid_prompts, max_new_tokens=2):
    """One request after another; each must be answered 200."""
    for rid, prompt in rid_prompts:
        server.post("/generate", generate_body(prompt, rid, max_new_tokens))


def error_count(server):
    return (dump_stats(server.log()) or {}).get("errors", 0)


# --- a full disk --------------------------------------------------------------------

# The largest file the scheduler may write while the disk is "full": the kernel refuses a
# write past it (EFBIG), as it refuses one past the end of a full disk (ENOSPC). 1 MiB is
# well above the server's log (tens of kB; the scheduler writes it too, and is held to the
# same limit) and above a 60-token file (124 kB), well below a 600-token one (1.24 MB).
FILE_SIZE_LIMIT = 1 << 20


def test_full_disk(model_l3, tmp_path):
    """A disk that refuses to grow a file: RLIMIT_FSIZE on the scheduler process and its
    children (the dump's writer process), set and lifted from the test with `resource.prlimit`
    while the server serves. The kernel then fails the dump's own write() (EFBIG, errno 27)
    as a full disk fails it (ENOSPC, errno 28), through the same error path. A size-limited
    tmpfs or a loop-mounted filesystem would give a real ENOSPC, but mounting needs
    CAP_SYS_ADMIN, which root in a container need not have (the tmpfs version of this test
    skipped in CI), nor may it create a user namespace to mount in; lowering a resource
    limit needs no privilege and holds for root as for any user (no capability exempts a
    process from its soft limit). Python ignores SIGXFSZ, so the write fails instead of the
    process being killed."""
    dump_dir, pid_file = tmp_path / "dump", tmp_path / "scheduler.pid"
    prompts = iter(random_prompts([60, 600, 20, 20, 20], seed=10))
    with Server(model_l3, tmp_path / "server.log", runtime_env(SGLANG_HS_DUMP_DIR=str(dump_dir)),
                ["--forward-hooks", report_pid_spec(pid_file)]) as server:
        server.wait_ready()
        scheduler = int(pid_file.read_text())
        limited = [scheduler, *child_pids(scheduler)]
        assert len(server.log().encode()) < FILE_SIZE_LIMIT // 4, "the log would run into the limit"
        no_limit = resource.prlimit(scheduler, resource.RLIMIT_FSIZE)
        for pid in limited:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, no_limit[1]))
        # 60 tokens (124 kB) fit; 600 (1.24 MB) do not: the file's own write fails.
        serve(server, [("fits-0", next(prompts)), ("too-big", next(prompts)), ("fits-1", next(prompts))])
        wait_for_manifest(dump_dir, 2)
        wait_until(lambda: error_count(server) == 1, 30, "the error to be counted")
        assert rids(dump_dir) == ["fits-0", "fits-1"]
        assert "hidden states dump: request 'too-big' not written: OSError(27, 'File too large')" \
            in server.log()

        # The file fits and its manifest line does not (the manifest is padded to the limit
        # with blank lines, which readers skip): the file is removed and the manifest is left
        # without a part of a line.
        manifest = dump_dir / MANIFEST_NAME
        with open(manifest, "ab") as f:
            f.write(b"\n" * (FILE_SIZE_LIMIT - manifest.stat().st_size))
        serve(server, [("fits-2", next(prompts))])
        wait_until(lambda: error_count(server) == 2, 30, "the error to be counted")
        assert "hidden states dump: request 'fits-2' not written: OSError(27, 'File too large')" \
            in server.log()
        assert manifest.stat().st_size == FILE_SIZE_LIMIT and manifest.read_bytes().endswith(b"\n")

        for pid in limited:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, no_limit)  # space freed
        serve(server, [("after-full", next(prompts))])
        wait_for_manifest(dump_dir, 3)
        assert rids(dump_dir) == ["fits-0", "fits-1", "after-full"]
        assert assert_consistent(dump_dir).unlisted == []
        assert dump_stats(server.log())["errors"] == 2


# --- the directory removed, or replaced by a file; hostile request ids --------------


@pytest.fixture(scope="module")
def fault_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def server(model_l3, fault_dir):
    dump_dir = fault_dir / "deep" / "er" / "dump"
    with Server(model_l3, fault_dir / "server.log", runtime_env(SGLANG_HS_DUMP_DIR=str(dump_dir))) as server:
        server.wait_ready()
        yield server


def test_directory_removed_while_writing(server):
    prompts = random_prompts([int(n) for n in range(20, 340, 10)], seed=11)
    bodies = [generate_body(p, f"removed-{i}", 2) for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(32) as pool:
        responses = pool.map(lambda body: server.post("/generate", body), bodies)
        wait_for_manifest(server.dump_dir, 3)
        shutil.rmtree(server.dump_dir, ignore_errors=True)
        assert len(list(responses)) == len(bodies)  # all answered 200

    later = random_prompts([30, 40], seed=12)
    serve(server, [("after-removal-0", later[0]), ("after-removal-1", later[1])])
    wait_until(lambda: {"after-removal-0", "after-removal-1"} <= set(rids(server.dump_dir)), 30,
               "the later requests in the recreated directory")
    assert set(rids(server.dump_dir)) <= {b["rid"] for b in bodies} | {"after-removal-0", "after-removal-1"}
    assert_consistent(server.dump_dir)
    print(f"after removal: {rids(server.dump_dir)}; {dump_stats(server.log())}")


def test_directory_replaced_by_a_file(server):
    shutil.rmtree(server.dump_dir)
    server.dump_dir.write_text("not a directory")
    errors = error_count(server)
    prompts = random_prompts([30, 40, 50, 60], seed=13)
    serve(server, [("unwritable-0", prompts[0]), ("unwritable-1", prompts[1])])
    wait_until(lambda: error_count(server) == errors + 2, 30, "both errors to be counted")
    assert "hidden states dump: request 'unwritable-1' not written: NotADirectoryError(20, 'Not a directory')" \
        in server.log()
    assert server.dump_dir.read_text() == "not a directory"

    server.dump_dir.unlink()
    server.dump_dir.mkdir()
    serve(server, [("writable-0", prompts[2]), ("writable-1", prompts[3])])
    wait_for_manifest(server.dump_dir, 2)
    assert rids(server.dump_dir) == ["writable-0", "writable-1"]
    assert_consistent(server.dump_dir)


def test_hostile_request_ids(server, fault_dir):
    outside = Path("/tmp") / f"hs-dump-hostile-{uuid.uuid4().hex}"
    hostile = [
        "../../x", "../../../../../../../../tmp/x-" + outside.name, str(outside / "abs"), "a/b/c", "a" * 10240,
        "nul\0byte", "ünï/çødé ✓ 🚀 日本語", "line\nbreak", TEMP_PREFIX + "evil", MANIFEST_NAME, ".", "",
    ]
    before = len(rids(server.dump_dir))
    tree_before = sorted(str(p) for p in fault_dir.rglob("*") if server.dump_dir not in p.parents)
    prompts = random_prompts([20] * len(hostile), seed=14)
    serve(server, list(zip(hostile, prompts)))
    manifest = wait_for_manifest(server.dump_dir, before + len(hostile))[before:]

    assert [e["rid"] for e in manifest] == hostile  # verbatim
    assert_consistent(server.dump_dir)
    assert sorted(p.name for p in server.dump_dir.iterdir() if p.name != MANIFEST_NAME) == \
        sorted(e["file"] for e in read_manifest(str(server.dump_dir)))
    assert sorted(str(p) for p in fault_dir.rglob("*") if server.dump_dir not in p.parents) == tree_before
    assert not outside.exists() and not (Path("/tmp") / ("x-" + outside.name)).exists()

    # Not Unicode text (a lone surrogate). Up to 0.5.14 the body is parsed by the stdlib's
    # json, which lets the rid through to the scheduler: SGLang itself cannot answer it (500),
    # and the dump cannot put it in the file's metadata: an error, counted, nothing written.
    # 0.5.23 parses every body with orjson, which refuses a lone surrogate: the request is
    # answered 400 before it is scheduled, and the dump never sees it.
    errors = error_count(server)
    body = json.dumps(generate_body(prompts[0], "\ud800lone", 2)).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    if RELEASE < (0, 5, 23):
        wait_until(lambda: error_count(server) == errors + 1, 30, "the error to be counted")
    else:
        assert refused.value.code == 400 and b"JSON decode error" in refused.value.read()
    serve(server, [("after-hostile", prompts[1])])
    wait_for_manifest(server.dump_dir, before + len(hostile) + 1)
    assert rids(server.dump_dir)[-1] == "after-hostile"
    assert_consistent(server.dump_dir)


# --- SIGKILL mid-dump, and a restart on the same directory --------------------------


def test_sigkill_mid_dump_and_restart(model_l3, tmp_path):
    dump_dir = tmp_path / "dump"
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(dump_dir))
    prompts = random_prompts([100 + 5 * i for i in range(64)], seed=15)
    first = Server(model_l3, tmp_path / "first.log", env).start()
    try:
        first.wait_ready()
        with ThreadPoolExecutor(64) as pool:
            def send(i):
                try:
                    first.post("/generate", generate_body(prompts[i], f"killed-{i}", 8))
                except (OSError, urllib.error.URLError):
                    pass  # the server is killed under it
            for i in range(64):
                pool.submit(send, i)
            wait_for_manifest(dump_dir, 5)
            first.kill()
    finally:
        first.__exit__(None, None, None)

    # What a reader sees right after the kill: every manifest line loads.
    entries = read_manifest(str(dump_dir))
    assert 5 <= len(entries) < 64
    partials = sorted(p.name for p in dump_dir.iterdir() if p.name.startswith(TEMP_PREFIX))
    assert summarise(dump_dir).problems == []
    # SIGKILL does not tear one write() of a short line; the loss of the machine can, and
    # a writer killed mid-file leaves a partial file: both planted here.
    (dump_dir / (TEMP_PREFIX + "planted.safetensors")).write_bytes(b"half a file")
    with open(dump_dir / MANIFEST_NAME, "ab") as f:
        f.write(b'{"rid": "torn", "file": "2026')
    assert read_manifest(str(dump_dir)) == entries

    with Server(model_l3, tmp_path / "second.log", env) as second:
        second.wait_ready()
        assert [p.name for p in dump_dir.iterdir() if p.name.startswith(TEMP_PREFIX)] == []
        assert (dump_dir / MANIFEST_NAME).read_bytes().endswith(b"\n")
        assert "hidden states dump: removing a torn last line" in second.log()
        later = random_prompts([40, 50, 60], seed=16)
        serve(second, [(f"restarted-{i}", p) for i, p in enumerate(later)])
        manifest = wait_for_manifest(dump_dir, len(entries) + 3)
    assert manifest[:len(entries)] == entries
    assert [e["rid"] for e in manifest[len(entries):]] == ["restarted-0", "restarted-1", "restarted-2"]
    summary = assert_consistent(dump_dir)
    print(f"killed with {len(entries)} files listed, {len(partials)} partial files, "
          f"{len(summary.unlisted)} complete files not listed (killed between rename and manifest line)")
