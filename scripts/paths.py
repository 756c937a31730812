"""Where the repository keeps things: one root that every wing of scripts/ resolves from."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# The one source of every file the series adds to SGLang, laid out as in the package root.
OVERLAY_ROOT = REPO_ROOT / "sglang_overlay"
CACHE_DIR = REPO_ROOT / ".cache"
