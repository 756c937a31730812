"""scripts.dumps.generate on real CPU servers: a dataset of 50 records (42 conversations and
every kind of bad record), the command SIGKILLed mid-run, then the server SIGKILLed mid-run,
then a rerun: every valid sample dumped exactly once, every bad record rejected exactly once,
loss masks equal to the assistant's tokens found without the implementation, both chat
template variants, and the exports read back by SpecForge's and speculators' own readers."""

import http.server
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import pytest
import torch

from scripts.dump_format import load_dump, read_manifest
from scripts.dumps import export_specforge, export_speculators, generate
from scripts.dumps.draft_config import VALUES_NAME
from scripts.dumps.exporting import INDEX_NAME
from scripts.dumps.samples import REJECTED_NAME, SAMPLES_NAME, mask_from_runs, mask_runs, read_lines
from scripts.dumps.server import Server, runtime_env
from scripts.dumps.tiny_tokenizer import ASSISTANT, CORPUS, EOS, write_tokenizer
from scripts.paths import REPO_ROOT

MAX_LENGTH = 400
SENTENCES = [s.strip() + "." for s in CORPUS.read_text().replace("\n", " ").split(". ") if len(s) > 20]

# (line text or bytes, the kind generate must reject it as)
BAD = [
    ('{"messages": [{"role": "user", "content": "cut short', "not_json"),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "ok"}]}', "not_utf8"),
    ('{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "ok"}]}', "not_utf8"),
    ('{"prompt": "a record of no known shape"}', "unknown_shape"),
    ('{"text": ["plain text", "in a list"]}', "unknown_shape"),
    ('[1, 2, 3]', "unknown_shape"),
    ('{"messages": [{"speaker": "user", "text": "hi"}]}', "unknown_shape"),
    ('{"messages": []}', "empty"),
    ('{"conversations": [{"from": "human", "value": "Anyone there?"}]}', "no_assistant"),
    (None, "too_long"),        # filled in below: a reply longer than MAX_LENGTH tokens
    ('{"id": "conv-3", "messages": [{"role": "user", "content": "again"}, {"role": "assistant", "content": "yes"}]}',
     "duplicate_id"),
    ('{"messages": [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "The answer is 42."}]}',
     "template"),            # the tiny template knows no tool role
]


def conversation(rng: random.Random, n: int) -> dict:
    turns = [{"role": "system", "content": "Answer in plain English."}] if n % 5 == 0 else []
    for _ in range(1 + n % 3):
        turns.append({"role": "user", "content": " ".join(rng.sample(SENTENCES, 1))})
        turns.append({"role": "assistant", "content": " ".join(rng.sample(SENTENCES, 2))})
    if n % 2:  # ShareGPT, without an id every third time
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        record = {"conversations": [{"from": names[t["role"]], "value": t["content"]} for t in turns]}
    else:
        record = {"messages": turns}
    if n % 6 != 1:
        record["id"] = f"conv-{n}"
    return record


def write_dataset(path: Path, conversations: int = 42):
    """The dataset, the valid records by rid, the bad ones' line numbers by kind (every
    kind, however few the conversations)."""
    rng = random.Random(12)
    lines, valid, bad = [], {}, {}
    records = [conversation(rng, n) for n in range(conversations)]
    too_long = {"messages": [{"role": "user", "content": "Tell me everything."},
                             {"role": "assistant", "content": " ".join(SENTENCES * 3)}]}
    bad_lines = [(json.dumps(too_long) if text is None else text, kind) for text, kind in BAD]
    for n, record in enumerate(records):
        lines.append(json.dumps(record, ensure_ascii=False))
        valid[record.get("id") or f"{path.stem}:{len(lines)}"] = record
        if n % 4 == 3 and bad_lines:
            text, kind = bad_lines.pop(0)
            lines.append(text)
            bad[len(lines)] = kind
        if n == 20:
            lines.append("")  # a blank line is no record
    for text, kind in bad_lines:
        lines.append(text)
        bad[len(lines)] = kind
    path.write_bytes(b"\n".join(line.encode() if isinstance(line, str) else line for line in lines) + b"\n")
    return valid, bad


def expected_mask(tokenizer, record: dict, input_ids: list) -> list:
    """The assistant's tokens, found without the chat template's rendering: after each
    <｜Assistant｜> the reply's own tokens and the end-of-sentence token."""
    turns = record.get("messages") or [{"role": t["from"], "content": t["value"]} for t in record["conversations"]]
    replies = [t["content"] for t in turns if t["role"] in ("assistant", "gpt")]
    assistant_id, eos_id = tokenizer.convert_tokens_to_ids([ASSISTANT, EOS])
    mask, reply = [0] * len(input_ids), 0
    for position, token in enumerate(input_ids):
        if token == assistant_id:
            reply_ids = tokenizer(replies[reply], add_special_tokens=False)["input_ids"] + [eos_id]
            assert input_ids[position + 1:position + 1 + len(reply_ids)] == reply_ids
            mask[position + 1:position + 1 + len(reply_ids)] = [1] * len(reply_ids)
            reply += 1
    assert reply == len(replies)
    return mask


def run_generate(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "scripts.dumps.generate", *map(str, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


def start_generate(*args):
    return subprocess.Popen([sys.executable, "-m", "scripts.dumps.generate", *map(str, args)], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_while_running(process, done, what: str, timeout: float = 300) -> None:
    """Poll `done()` until it holds; the generate command `process` (if any) must still run."""
    deadline = time.monotonic() + timeout
    while not done():
        assert process is None or process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, f"{what} after {timeout}s"
        time.sleep(0.02)


def wait_for_samples(out: Path, count: int, process=None, timeout: float = 300) -> None:
    wait_while_running(process, lambda: len(read_lines(out / SAMPLES_NAME)) >= count,
                       f"fewer than {count} samples", timeout)


def dumping_processes(out: Path):
    """Processes whose environment dumps into `out`."""
    marker = f"SGLANG_HS_DUMP_DIR={out}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            pass
    return found


def check_complete(out: Path, valid: dict, bad: dict) -> None:
    """Every valid sample once in the manifest and once in samples.jsonl; every bad line
    once in rejected.jsonl, with its kind."""
    manifest = Counter(entry["rid"] for entry in read_manifest(str(out)))
    samples = Counter(line["rid"] for line in read_lines(out / SAMPLES_NAME))
    assert manifest == Counter(list(valid)) == samples
    rejected = read_lines(out / REJECTED_NAME)
    assert Counter(r["line"] for r in rejected) == Counter(list(bad))
    assert {r["line"]: r["kind"] for r in rejected} == bad


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    valid, bad = write_dataset(path)
    return path, valid, bad


# Layers an EAGLE-3 draft config can name on every release here (the 3-layer model's
# default, [1, 2, 3], is fed to no draft of 0.5.23: ids [1, 2] become [2, 3]), and L.
DUMP_LAYERS = "2,0,3"


@pytest.fixture(scope="module")
def killed_and_resumed(model_l3, dataset, tmp_path_factory):
    """The dump after: generate (its own server) SIGKILLed mid-run; a rerun against a
    separate server SIGKILLed mid-run; a rerun against a new server."""
    path, valid, bad = dataset
    out = tmp_path_factory.mktemp("generate") / "dump"
    options = ["--dataset", path, "--out", out, "--max-length", MAX_LENGTH, "--concurrency", 1]

    command = start_generate(*options, "--model", model_l3, "--dump-layers", DUMP_LAYERS)
    wait_for_samples(out, 8, command)
    command.send_signal(signal.SIGKILL)
    command.wait()
    deadline = time.monotonic() + 60  # the server it started dies with it
    while dumping_processes(out):
        assert time.monotonic() < deadline, "the server of a killed generate is still running"
        time.sleep(0.2)
    after_command_kill = len(read_lines(out / SAMPLES_NAME))
    assert 8 <= after_command_kill < len(valid)

    server = Server(model_l3, out.with_name("server-1.log"), runtime_env(SGLANG_HS_DUMP_DIR=str(out), SGLANG_HS_DUMP_LAYERS=DUMP_LAYERS))
    with server:
        server.wait_ready()
        command = start_generate(*options, "--server", f"http://127.0.0.1:{server.port}", "--model", model_l3,
                                 "--retries", 1)
        wait_for_samples(out, after_command_kill + 8, command)
        server.kill()
        output, _ = command.communicate(timeout=120)
    assert command.returncode == 1, output
    assert "run the same command again" in output
    after_server_kill = len(read_lines(out / SAMPLES_NAME))
    assert after_server_kill < len(valid)

    with Server(model_l3, out.with_name("server-2.log"), runtime_env(SGLANG_HS_DUMP_DIR=str(out), SGLANG_HS_DUMP_LAYERS=DUMP_LAYERS)) as server:
        server.wait_ready()
        url = f"http://127.0.0.1:{server.port}"
        result = run_generate(*options, "--server", url, "--model", model_l3)
        assert result.returncode == 0, result.stdout + result.stderr
        check_complete(out, valid, bad)

        # The command died between a manifest line and its samples line: the rerun writes
        # the line and sends nothing.
        samples = (out / SAMPLES_NAME).read_bytes().splitlines(keepends=True)
        (out / SAMPLES_NAME).write_bytes(b"".join(samples[:-1]))
        result = run_generate(*options, "--server", url, "--model", model_l3)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "completed from the manifest: 1" in result.stdout
        assert f"skipped as done: {len(valid) - 1}" in result.stdout
        assert f"{len(bad)} recorded by an earlier run" in result.stdout
        check_complete(out, valid, bad)
    return out


def test_every_sample_once_after_kills(killed_and_resumed, dataset):
    _, valid, bad = dataset
    check_complete(killed_and_resumed, valid, bad)


def test_rejections_name_their_line_and_reason(killed_and_resumed, dataset):
    path, _, bad = dataset
    rejected = {r["line"]: r for r in read_lines(killed_and_resumed / REJECTED_NAME)}
    too_long = next(line for line, kind in bad.items() if kind == "too_long")
    assert f"more than {MAX_LENGTH}" in rejected[too_long]["reason"]
    duplicate = next(line for line, kind in bad.items() if kind == "duplicate_id")
    assert rejected[duplicate]["reason"].startswith("the id 'conv-3' of line")
    assert all(r["reason"] for r in rejected.values())
    # Each names its record's rid: its id, else the dataset's name and the line; none for a
    # line that is no JSON object.
    assert rejected[duplicate]["rid"] == "conv-3"
    assert {line: r["rid"] for line, r in rejected.items()} == {line: rid_of_line(path, line) for line in bad}


def rid_of_line(path: Path, line: int) -> Optional[str]:
    text = path.read_bytes().split(b"\n")[line - 1]
    try:
        value = json.loads(text.decode("utf-8"))
    except ValueError:
        return None
    return (value.get("id") or f"{path.stem}:{line}") if isinstance(value, dict) else None


def test_loss_masks_are_the_assistant_tokens(killed_and_resumed, dataset, model_l3):
    from transformers import AutoTokenizer

    _, valid, _ = dataset
    tokenizer = AutoTokenizer.from_pretrained(str(model_l3))
    files = {entry["rid"]: entry["file"] for entry in read_manifest(str(killed_and_resumed))}
    for line in read_lines(killed_and_resumed / SAMPLES_NAME):
        record = load_dump(str(killed_and_resumed / files[line["rid"]]))
        input_ids = record.token_ids.tolist()
        assert line["num_tokens"] == len(input_ids)
        assert mask_from_runs(line["loss_mask"]) == expected_mask(tokenizer, valid[line["rid"]], input_ids)


def test_generation_markers_give_the_same_masks(killed_and_resumed, dataset, model_l3, tmp_path):
    """The template variant with {% generation %} markers (transformers' assistant mask)."""
    path, valid, _ = dataset
    model = tmp_path / "model"
    model.mkdir()
    for file in model_l3.iterdir():
        (model / file.name).symlink_to(file)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / name).unlink()
    write_tokenizer(model, generation_markers=True)
    assert "{% generation %}" in json.loads((model / "tokenizer_config.json").read_text())["chat_template"]
    out = tmp_path / "dump"
    result = run_generate("--dataset", path, "--out", out, "--max-length", MAX_LENGTH, "--model", model, "--limit", 12)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "loss mask: generation markers" in result.stderr
    plain = {line["rid"]: line for line in read_lines(killed_and_resumed / SAMPLES_NAME)}
    marked = read_lines(out / SAMPLES_NAME)
    assert len(marked) >= 9
    for line in marked:
        assert line["loss_mask"] == plain[line["rid"]]["loss_mask"]
        assert line["line"] == plain[line["rid"]]["line"]


def test_a_template_without_a_mask_is_refused(dataset, model_l3, tmp_path):
    # Rewrites earlier assistant turns (as templates that drop past reasoning do).
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[earlier]"
                        "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}")
    path, _, _ = dataset
    result = run_generate("--dataset", path, "--out", tmp_path / "dump", "--model", model_l3,
                          "--chat-template", template)
    assert result.returncode == 2
    assert "--loss-mask all" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "dump" / SAMPLES_NAME).exists()


class InfoWithoutModel(http.server.BaseHTTPRequestHandler):
    """A server whose /server_info names no model_path."""

    def do_GET(self):
        body = json.dumps({"max_req_input_len": 4096}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_server_without_model_path_is_a_clear_error(tmp_path, capsys):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), InfoWithoutModel)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    dataset = tmp_path / "data.jsonl"
    dataset.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "hello"}]}) + "\n")
    try:
        assert generate.main(["--dataset", str(dataset), "--out", str(tmp_path / "dump"), "--server", url]) == 1
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert f"--server {url}: its /server_info (or /get_server_info) names no model_path" in err
    assert "Traceback" not in err


def test_mask_runs_round_trip():
    for mask in ([], [1], [0], [0, 0, 1, 1, 1, 0], [1, 1, 0, 1]):
        assert mask_from_runs(mask_runs(mask)) == mask
    assert mask_runs([1, 1, 0, 1]) == [0, 2, 1, 1]


def test_specforge_reads_the_export(killed_and_resumed, tmp_path):
    from specforge.data.preprocessing import build_offline_eagle3_dataset

    out = tmp_path / "specforge"
    assert export_specforge.main([str(killed_and_resumed), str(out)]) == 0
    masks = {line["rid"]: mask_from_runs(line["loss_mask"]) for line in read_lines(killed_and_resumed / SAMPLES_NAME)}
    index = {json.loads(line)["idx"]: json.loads(line) for line in (out / INDEX_NAME).read_text().splitlines()}
    assert sorted(entry["rid"] for entry in index.values()) == sorted(masks)
    dataset = build_offline_eagle3_dataset(str(out), max_len=2048)
    assert len(dataset) == len(masks)
    for i, path in enumerate(dataset.datapaths):
        entry = index[int(str(path).rsplit("data_", 1)[1].split(".")[0])]
        record, item = load_dump(str(killed_and_resumed / entry["file"])), dataset[i]
        assert torch.equal(item["input_ids"][0], record.token_ids)
        assert item["loss_mask"][0].tolist() == masks[entry["rid"]][:-1] + [0]  # SpecForge masks the last
        aux = record.hidden_states[:, [record.layer_ids.index(0), record.layer_ids.index(2)]]  # ascending, below L
        assert torch.equal(item["hidden_state"][0], aux.reshape(record.token_ids.numel(), -1))


def test_speculators_reads_the_export(killed_and_resumed, tmp_path):
    from speculators.data_generation.offline import check_hidden_states
    from speculators.train.data import ArrowDataset
    from hs_connectors import FileTransfer

    out = tmp_path / "speculators"
    assert export_speculators.main([str(killed_and_resumed), str(out)]) == 0
    samples = read_lines(killed_and_resumed / SAMPLES_NAME)
    files = {entry["rid"]: entry["file"] for entry in read_manifest(str(killed_and_resumed))}
    dataset = ArrowDataset(max_len=2048, datapath=str(out), on_missing="raise")
    assert len(dataset) == len(samples)
    transfer = FileTransfer(out / "hidden_states")
    for i, line in enumerate(samples):
        record = load_dump(str(killed_and_resumed / files[line["rid"]]))
        num_layers = int(record.metadata["num_layers"])
        assert num_layers in record.layer_ids  # the tiny model's default layers include L
        aux = [record.layer_ids.index(layer) for layer in record.layer_ids if layer != num_layers]
        check_hidden_states(transfer.get_cached(i), record.token_ids.tolist())
        item = dataset[i]
        assert torch.equal(item["input_ids"], record.token_ids)
        assert item["loss_mask"].tolist() == mask_from_runs(line["loss_mask"])
        assert torch.equal(item["hidden_states"], record.hidden_states[:, aux].flatten(1))
        assert torch.equal(item["verifier_last_hidden_states"],
                           record.hidden_states[:, record.layer_ids.index(num_layers)])


def test_exports_refuse_layers_the_dump_lacks(tmp_path, killed_and_resumed, capsys):
    assert export_speculators.main([str(killed_and_resumed), str(tmp_path / "a"), "--layers", "1,3"]) == 2
    assert "always exported last" in capsys.readouterr().err
    for export in (export_speculators, export_specforge):
        assert export.main([str(killed_and_resumed), str(tmp_path / "b"), "--layers", "0,1"]) == 1
        assert "the dump holds the layers [2, 0, 3], not [1]" in capsys.readouterr().err
        assert not (tmp_path / "b").exists()


def test_speculators_export_names_its_ids_and_refuses_a_draft_config_off_by_one(tmp_path, killed_and_resumed, capsys):
    """speculators names a layer by its output (id k: the output of decoder layer k), so the
    dump's layers [2, 0] (the residual stream entering each) are its [1, -1]."""
    out = tmp_path / "out"
    assert export_speculators.main([str(killed_and_resumed), str(out)]) == 0
    values = json.loads((out / VALUES_NAME).read_text())
    assert values["eagle_aux_hidden_state_layer_ids"] == [1, -1]
    assert "output of decoder layer 2 before the final norm" in values["final_state"]

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [2, 0]}))  # the dump's ids, taken as they are
    assert export_speculators.main([str(killed_and_resumed), str(tmp_path / "bad"), "--draft-config", str(config)]) == 1
    assert "so a draft trained on it names [1, -1]" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    config.write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [1, -1]}))
    assert export_speculators.main([str(killed_and_resumed), str(tmp_path / "ok"), "--draft-config", str(config)]) == 0
