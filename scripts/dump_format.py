"""The dump's format for the tools: the series' format module
(sglang/srt/hidden_states_dump/format.py), loaded from its one source in sglang_overlay/ by
its path, so that reading a dump needs torch and safetensors alone, not SGLang. The tools
and tests read dumps through this module, never through the server's side of the package.
"""

import importlib.util
import sys

from scripts.paths import OVERLAY_DIR

PACKAGE_DIR = OVERLAY_DIR / "sglang" / "srt" / "hidden_states_dump"


def _load(source: str, module_name: str):
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, PACKAGE_DIR / source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


_format = _load("format.py", "hidden_states_dump_format")
# What the Mooncake sink puts in a store and its control directory, and the MOONCAKE_*
# settings a store's clients read (each imports nothing more).
_store_layouts = _load("store_layouts.py", "hidden_states_dump_store_layouts")
_store_settings = _load("store_settings.py", "hidden_states_dump_store_settings")

CHECKSUM_FIELD = _format.CHECKSUM_FIELD
ChecksumMismatch = _format.ChecksumMismatch
check_checksum = _format.check_checksum
checksum_of = _format.checksum_of
file_checksum = _format.file_checksum
nonfinite_rows = _format.nonfinite_rows
DumpCounters = _format.DumpCounters
DumpRecord = _format.DumpRecord
DumpTimings = _format.DumpTimings
FP8_ENCODING = _format.FP8_ENCODING
LOSS_MASK_PARAM = _format.LOSS_MASK_PARAM
META_INFO_KEY = _format.META_INFO_KEY
DUMP_PARAM = _format.DUMP_PARAM
PRIVATE_PARAM = _format.PRIVATE_PARAM
ANSWER_PARAM = _format.ANSWER_PARAM
ANSWER_TOKENS_FIELD = _format.ANSWER_TOKENS_FIELD
REQUEST_SAMPLE_FIELD = _format.REQUEST_SAMPLE_FIELD
MooncakeSettings = _store_settings.MooncakeSettings
REF_CHANNEL = _store_layouts.REF_CHANNEL
MANIFEST_NAME = _format.MANIFEST_NAME
ManifestFollower = _format.ManifestFollower
TEMP_PREFIX = _format.TEMP_PREFIX
dequantize_rows = _format.dequantize_rows
load_dump = _format.load_dump
manifest_name = _format.manifest_name
manifest_paths = _format.manifest_paths
quantize_rows = _format.quantize_rows
read_manifest = _format.read_manifest
sample_name = _format.sample_name
safetensors_header = _format.safetensors_header
tensor_bytes = _format.tensor_bytes
