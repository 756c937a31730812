"""The whole path on a tiny DeepSeek-V3: a chat dataset in, training data for SpecForge and
speculators out.

    make demo            (or: python -m scripts.dumps.demo [--out DIR])

1. generate: start the patched server on the tiny model (its tokenizer and DeepSeek-V3-style
   chat template), send scripts/dumps/data/demo_conversations.jsonl with assistant loss
   masks, dump EAGLE-3's layers and the last layer, stop the server;
2. inspect the dump (every file against the manifest);
3. export it for SpecForge (EAGLE-3's layers) and for speculators (those and the last layer).
"""

import argparse
import sys
import tempfile
from pathlib import Path

from scripts.dumps import export_specforge, export_speculators, generate
from scripts.dumps.inspect_dump import report, summarise
from scripts.dumps.tiny_model import ensure_model
from scripts.paths import REPO_ROOT

DATASET = REPO_ROOT / "scripts" / "dumps" / "data" / "demo_conversations.jsonl"
NUM_LAYERS = 8
EAGLE3_LAYERS = "3,5,6"  # EAGLE-3's default for 8 layers: 3, L//2+1, L-2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="default: a new temporary folder")
    args = parser.parse_args(argv)

    out = args.out or Path(tempfile.mkdtemp(prefix="hs-demo-"))
    dump = out / "dump"
    model = ensure_model(layers=NUM_LAYERS)
    print(f"model: {model}\n\n== 1. generate", flush=True)
    status = generate.main(["--dataset", str(DATASET), "--out", str(dump), "--model", str(model),
                            "--dump-layers", f"{EAGLE3_LAYERS},{NUM_LAYERS}"])
    if status != 0:
        return status
    print("\n== 2. inspect the dump", flush=True)
    summary = summarise(dump)
    print(report(dump, summary))
    if summary.problems:
        return 1
    print("\n== 3. export", flush=True)
    status = (export_specforge.main([str(dump), str(out / "specforge"), "--layers", EAGLE3_LAYERS])
              or export_speculators.main([str(dump), str(out / "speculators")]))
    if status == 0:
        print(f"\nSpecForge's offline hidden states: {out / 'specforge'}"
              f"\nspeculators' data path: {out / 'speculators'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
