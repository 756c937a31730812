"""The dump's format for the tools: the series' format module
(sglang/srt/hidden_states_dump/format.py), loaded from its one source in sglang_overlay/ by
its path, so that reading a dump needs torch and safetensors alone, not SGLang. The tools
and tests read dumps through this module, never through the server's side of the package.
"""

import importlib.util
import sys

from scripts.paths import OVERLAY_DIR

FORMAT_SOURCE = OVERLAY_DIR / "sglang" / "srt" / "hidden_states_dump" / "format.py"
MODULE_NAME = "hidden_states_dump_format"


def _load():
    if MODULE_NAME in sys.modules:
        return sys.modules[MODULE_NAME]
    spec = importlib.util.spec_from_file_location(MODULE_NAME, FORMAT_SOURCE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


_format = _load()

DumpCounters = _format.DumpCounters
DumpRecord = _format.DumpRecord
DumpTimings = _format.DumpTimings
FP8_ENCODING = _format.FP8_ENCODING
MANIFEST_NAME = _format.MANIFEST_NAME
ManifestFollower = _format.ManifestFollower
TEMP_PREFIX = _format.TEMP_PREFIX
dequantize_rows = _format.dequantize_rows
load_dump = _format.load_dump
manifest_name = _format.manifest_name
manifest_paths = _format.manifest_paths
quantize_rows = _format.quantize_rows
read_manifest = _format.read_manifest
safetensors_header = _format.safetensors_header
tensor_bytes = _format.tensor_bytes
