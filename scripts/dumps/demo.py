"""The main job on the embedded tiny model: start the patched server with dumping on, send a
few prompts, summarise what was dumped, stop the server.

    make demo            (or: python -m scripts.dumps.demo [--dump-dir DIR] [--layers 0,2,3])
"""

import argparse
import random
import sys
import tempfile
from pathlib import Path

from scripts.dumps.inspect_dump import report, summarise
from scripts.dumps.server import Server, runtime_env, wait_for_manifest
from scripts.dumps.tiny_model import ensure_model

PROMPT_LENGTHS = (5, 17, 64, 300)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dump-dir", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--layers", default=None, help="SGLANG_HS_DUMP_LAYERS (default: EAGLE-3's)")
    parser.add_argument("--num-layers", type=int, default=8, help="layers of the tiny model (8: EAGLE-3 default layers [3, 5, 6])")
    args = parser.parse_args(argv)

    dump_dir = args.dump_dir or Path(tempfile.mkdtemp(prefix="hs-dump-"))
    model = ensure_model(layers=args.num_layers)
    print(f"model: {model}")
    env = {"SGLANG_HS_DUMP_DIR": str(dump_dir)}
    if args.layers:
        env["SGLANG_HS_DUMP_LAYERS"] = args.layers
    log_path = dump_dir.parent / f"{dump_dir.name}.server.log"
    rng = random.Random(0)
    with Server(model, log_path, runtime_env(**env)) as server:
        print(f"starting the patched server (log: {log_path}) ...")
        server.wait_ready()
        for length in PROMPT_LENGTHS:
            prompt = [rng.randrange(5, 1000) for _ in range(length)]
            server.generate(prompt, max_new_tokens=4)
        wait_for_manifest(dump_dir, len(PROMPT_LENGTHS))
    summary = summarise(dump_dir)
    print(report(dump_dir, summary))
    return 1 if summary.problems or summary.requests != len(PROMPT_LENGTHS) else 0


if __name__ == "__main__":
    sys.exit(main())
