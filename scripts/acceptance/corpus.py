"""The corpus the acceptance target learns: the Python source of pinned, openly licensed
packages, which every machine here holds (the GPU bundle and the runtime environments alike).

Files, not lines, are split, by a hash of their path inside the package, so no file is in two
splits: `valid` (held-out perplexity) and `prompts` (held-out acceptance prompts) take about 2%
each, `train` the rest. `describe()` records the packages, their versions and licenses, each
split's files and bytes and a digest of its text, so a step on another machine can prove it
reads the same corpus (`check()` refuses one that differs).
"""

import hashlib
from dataclasses import dataclass
from importlib import metadata
from typing import Dict, Iterator, List, Tuple

from scripts.toolchain.errors import ToolError

# (distribution, version): the transformers release SGLang 0.5.14 and SpecForge 0.2.0 pin; its
# modeling code repeats itself across models, which is what makes a draft's guesses land.
PACKAGES: Tuple[Tuple[str, str], ...] = (("transformers", "5.8.1"),)
SPLITS = ("train", "valid", "prompts")
HELD_OUT_PERCENT = {"valid": 2, "prompts": 2}


@dataclass(frozen=True)
class SourceFile:
    package: str
    path: str  # inside the distribution, as its RECORD names it
    text: str

    @property
    def split(self) -> str:
        bucket = int.from_bytes(hashlib.sha256(f"{self.package}/{self.path}".encode()).digest()[:4], "big") % 100
        if bucket < HELD_OUT_PERCENT["valid"]:
            return "valid"
        if bucket < HELD_OUT_PERCENT["valid"] + HELD_OUT_PERCENT["prompts"]:
            return "prompts"
        return "train"


def _distribution(name: str, version: str) -> metadata.Distribution:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise ToolError(f"the corpus is the source of {name} {version}, which is not installed here")
    if dist.version != version:
        raise ToolError(f"the corpus is the source of {name} {version}; this environment has {dist.version}")
    return dist


def license_of(dist: metadata.Distribution) -> str:
    meta = dist.metadata
    for key in ("License-Expression", "License"):
        value = meta.get(key)
        if value and len(value) < 80:
            return value
    classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    return ", ".join(classifiers) or "unknown"


def files() -> Iterator[SourceFile]:
    """Every .py file of the packages, in a fixed order; files that are not UTF-8 or are empty are left out."""
    for name, version in PACKAGES:
        dist = _distribution(name, version)
        for path in sorted(str(p) for p in dist.files or () if str(p).endswith(".py")):
            try:
                text = dist.locate_file(path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if text.strip():
                yield SourceFile(name, path, text)


def split(name: str) -> List[SourceFile]:
    if name not in SPLITS:
        raise ToolError(f"the corpus has the splits {', '.join(SPLITS)}, not {name!r}")
    return [f for f in files() if f.split == name]


def describe() -> Dict[str, object]:
    splits = {name: {"files": 0, "bytes": 0, "sha256": hashlib.sha256()} for name in SPLITS}
    for f in files():
        entry = splits[f.split]
        entry["files"] += 1
        data = f.text.encode()
        entry["bytes"] += len(data)
        entry["sha256"].update(f"{f.package}/{f.path}\0".encode() + data + b"\0")
    packages = [{"name": name, "version": version, "license": license_of(_distribution(name, version))}
                for name, version in PACKAGES]
    return {
        "what": "the .py files of these packages, split by file (sha256 of package/path mod 100)",
        "packages": packages,
        "held_out_percent": HELD_OUT_PERCENT,
        "splits": {name: {"files": e["files"], "bytes": e["bytes"], "sha256": e["sha256"].hexdigest()}
                   for name, e in splits.items()},
    }


def check(recorded: Dict[str, object]) -> None:
    """Refuses a corpus other than the one `recorded` (an earlier describe()) names."""
    here = describe()
    if here["splits"] != recorded["splits"] or here["packages"] != recorded["packages"]:
        raise ToolError(f"this machine's corpus differs from the one the target was trained on: "
                        f"recorded {recorded['splits']}, here {here['splits']}")
