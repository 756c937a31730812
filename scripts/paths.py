"""Where the repository keeps things: one root that every wing of scripts/ resolves from."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO_ROOT / ".cache"
OVERLAY_DIR = REPO_ROOT / "sglang_overlay"
