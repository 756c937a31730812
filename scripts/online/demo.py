"""The online path on a tiny DeepSeek-V3: a chat dataset in, every sample read back by a
trainer's stream, with no rows on disk.

    make demo-online     (or: python -m scripts.online.demo [--out DIR] [--layout hs-connectors])

1. start a local Mooncake store: mooncake_master and the store's memory (scripts/online/master.py);
2. generate --sink mooncake: start the patched server on the tiny model, send
   scripts/dumps/data/demo_conversations.jsonl; each sample's rows go into the store, its
   manifest line (and, in SpecForge's layout, its SampleRef) into the control directory;
3. read every sample back with HiddenStatesStream, acknowledge it (which removes it from
   the store), and check that the store is empty and the control directory holds no rows.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

from scripts.dump_format import read_manifest
from scripts.dumps import generate
from scripts.dumps.demo import DATASET, EAGLE3_LAYERS, NUM_LAYERS
from scripts.dumps.progress import human_bytes
from scripts.dumps.tiny_model import ensure_model
from scripts.online.master import MooncakeMaster
from scripts.online.stream import HiddenStatesStream


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--layout", choices=("specforge", "hs-connectors"), default="specforge")
    args = parser.parse_args(argv)

    out = args.out or Path(tempfile.mkdtemp(prefix="hs-demo-online-"))
    control = out / "control"
    model = ensure_model(layers=NUM_LAYERS)
    print(f"model: {model}\n\n== 1. a local Mooncake store", flush=True)
    with MooncakeMaster(out / "mooncake.log", segment_size=1 << 30) as master:
        os.environ.update(master.env())
        print("\n".join(f"{name}={value}" for name, value in master.env().items()), flush=True)
        print("\n== 2. generate --sink mooncake", flush=True)
        layers = EAGLE3_LAYERS if args.layout == "specforge" else f"{EAGLE3_LAYERS},{NUM_LAYERS}"
        status = generate.main(["--dataset", str(DATASET), "--out", str(control), "--model", str(model),
                                "--dump-layers", layers, "--sink", "mooncake", "--sink-layout", args.layout])
        if status != 0:
            return status
        print("\n== 3. read every sample back, as a trainer does", flush=True)
        published = read_manifest(str(control))
        stream = HiddenStatesStream(control, fields="specforge", idle_timeout_s=60)
        read, tokens = [], 0
        for sample in stream:
            read.append(sample["sample_id"])
            tokens += sample["input_ids"].numel()
            stream.ack([sample["sample_id"]])
        rows = [name for name in os.listdir(control) if name.endswith(".safetensors")]
        print(f"published {len(published)} samples ({human_bytes(sum(line['bytes'] for line in published))} in the "
              f"store); read and acknowledged {len(read)} ({tokens} tokens); rows on disk: {len(rows)} files")
        again = list(HiddenStatesStream(control, idle_timeout_s=60))
        if sorted(read) != sorted(line["sample_id"] for line in published) or again or rows:
            print("error: the stream did not read every published sample exactly once", file=sys.stderr)
            return 1
    print(f"\ncontrol directory: {control}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
