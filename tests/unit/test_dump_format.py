"""The format module is the reader a trainer's machine uses: torch and safetensors alone."""

import json
import subprocess
import sys

import pytest
import torch

from scripts.paths import REPO_ROOT
from sglang.srt.hidden_states_dump.requests import DumpRequest
from tests.unit.dump_standins import layer_rows, prompt, run_forward, start_dumper, wait_for_manifest

# Run in a fresh interpreter in which importing anything named sglang fails.
READ_WITHOUT_SGLANG = """
import importlib.abc, json, sys

class NoSGLang(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "sglang" or name.startswith("sglang."):
            raise ImportError(f"{name} must not be imported by the dump's reader")

sys.meta_path.insert(0, NoSGLang())
sys.path.insert(0, sys.argv[1])
from scripts.dump_format import load_dump, read_manifest

[entry] = read_manifest(sys.argv[2])
record = load_dump(sys.argv[2] + "/" + entry["file"])
print(json.dumps({"rid": entry["rid"], "tokens": record.token_ids.tolist(),
                  "layers": record.layer_ids, "hidden": record.hidden_states.tolist(),
                  "loaded": sorted(name for name in sys.modules if name.startswith("sglang"))}))
"""


def read_in_a_fresh_interpreter(dump_dir, script=READ_WITHOUT_SGLANG):
    return subprocess.run([sys.executable, "-I", "-c", script, str(REPO_ROOT), str(dump_dir)],
                          capture_output=True, text=True, timeout=120)


def test_a_dump_reads_where_sglang_cannot_be_imported(dump_dir):
    dumper = start_dumper(dump_dir, [2, 1])
    tokens = prompt(100, 5)
    run_forward(dumper, [(DumpRequest("r", 5), tokens, 0)])
    wait_for_manifest(dump_dir, ["r"])

    result = read_in_a_fresh_interpreter(dump_dir)

    assert result.returncode == 0, result.stderr
    read = json.loads(result.stdout)
    assert read["rid"] == "r" and read["tokens"] == tokens and read["layers"] == [2, 1]
    expected = torch.stack([layer_rows(tokens, 2), layer_rows(tokens, 1)], dim=1)
    assert torch.equal(torch.tensor(read["hidden"]), expected)
    assert read["loaded"] == []


def test_the_blocker_stops_an_import_of_sglang(dump_dir):
    """The negative control: the same interpreter fails when the reader reaches for sglang."""
    script = READ_WITHOUT_SGLANG.replace("from scripts.dump_format import", "import sglang.srt.hidden_states_dump.format\nfrom scripts.dump_format import")
    result = read_in_a_fresh_interpreter(dump_dir, script)
    assert result.returncode != 0
    assert "must not be imported by the dump's reader" in result.stderr


def test_a_byte_flipped_in_the_rows_is_refused_by_name_and_an_untouched_file_loads(tmp_path):
    from sglang.srt.hidden_states_dump.format import (
        ChecksumMismatch, file_checksum, load_dump, read_manifest)

    dumper = start_dumper(tmp_path, [0, 2])
    run_forward(dumper, [(DumpRequest("r", 9), prompt(300, 9), 0)])
    [entry] = wait_for_manifest(tmp_path, ["r"])
    path = tmp_path / entry["file"]
    # The negative control: untouched, it loads checked, and hashes to its line's checksum.
    assert load_dump(str(path), checksum=entry["checksum"]).token_ids.tolist() == prompt(300, 9)
    assert file_checksum(str(path), entry["checksum"]) == entry["checksum"]
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + (len(data) - header) // 2] ^= 0x01  # inside the rows, past the header
    path.write_bytes(bytes(data))
    assert load_dump(str(path)).token_ids.numel() == 9  # still a valid safetensors file
    with pytest.raises(ChecksumMismatch, match=entry["file"]):
        load_dump(str(path), checksum=entry["checksum"])
    assert file_checksum(str(path), entry["checksum"]) != entry["checksum"]
    assert read_manifest(str(tmp_path))[0]["checksum"] == entry["checksum"]
