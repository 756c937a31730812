"""The acceptance benchmark, one step at a time, each whole and within one GPU call (10 minutes):

    python -m scripts.acceptance.run target --out OUT
    python -m scripts.acceptance.run pipeline --contenders ours-seed1,untrained --out OUT

`target` trains the target (scripts/acceptance/target.py) and leaves OUT/model.safetensors,
OUT/model-files.tar.gz (its config and tokenizer) and OUT/target.json; committed under
results/gpu/acceptance/target/, they are what every later step serves.

`pipeline` runs the path as a user runs it, for each contender named: the training split as
plain text records -> `generate` on SGLang 0.5.14 with dumping on -> `export_specforge
--draft-config` -> SpecForge's own `specforge train` on the export -> the draft served by SGLang
with `--speculative-algorithm EAGLE3` -> acceptance length on held-out prompts, greedy and at
temperature 0.7, from the server's own counters. Each contender's result is written to
OUT/acceptance.json as soon as it is measured (scripts/acceptance/contenders.py).
"""

import argparse
import json
import shutil
import sys
import tarfile
import time
from pathlib import Path

from scripts.paths import REPO_ROOT
from scripts.toolchain.errors import ToolError

TARGET_RESULTS = REPO_ROOT / "results" / "gpu" / "acceptance" / "target"
WEIGHTS = "model.safetensors"
MODEL_FILES = "model-files.tar.gz"


def step_target(out: Path, steps: int, deadline_s: float) -> None:
    from scripts.acceptance import target

    work = out / "target-work"
    record = target.train(work, steps, deadline_s)
    model_dir = work / "model"
    shutil.move(str(model_dir / WEIGHTS), out / WEIGHTS)
    with tarfile.open(out / MODEL_FILES, "w:gz") as tar:
        for path in sorted(model_dir.iterdir()):
            tar.add(path, arcname=path.name)
    shutil.move(str(work / "target.json"), out / "target.json")
    shutil.rmtree(work)
    print(json.dumps({"held_out": record["held_out"], "trained_steps": record["trained_steps"],
                      "seconds": record["seconds"]}))


def target_model(into: Path) -> Path:
    """The committed target as a model folder under `into` (its weights and files unpacked)."""
    weights = TARGET_RESULTS / WEIGHTS
    if not weights.exists():
        raise ToolError(f"no trained target at {TARGET_RESULTS}: run the `target` step first and commit what it leaves")
    model = into / "target-model"
    model.mkdir(parents=True, exist_ok=True)
    with tarfile.open(TARGET_RESULTS / MODEL_FILES) as tar:
        tar.extractall(model, filter="data")
    shutil.copy(weights, model / WEIGHTS)
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("target", "pipeline"))
    parser.add_argument("--out", type=Path, required=True, help="where results and logs land as they are made")
    parser.add_argument("--steps", type=int, help="target: training steps (default: the recipe's)")
    parser.add_argument("--deadline-s", type=float, default=450.0, help="target: stop training after this long")
    parser.add_argument("--contenders", default="untrained,ours-seed1",
                        help="pipeline: the contenders, comma-separated (scripts/acceptance/contenders.py)")
    parser.add_argument("--work", type=Path, default=Path("/dev/shm/acceptance"),
                        help="pipeline: where the dump, the exports and the drafts go")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    try:
        if args.step == "target":
            from scripts.acceptance.target import RECIPE

            step_target(args.out, args.steps or RECIPE["steps"], args.deadline_s)
        else:
            from scripts.acceptance.contenders import run_pipeline

            run_pipeline(target_model(args.work), args.work, args.out, args.contenders.split(","))
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"step {args.step} took {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
