"""The contenders of the acceptance table, each trained by SpecForge's own `specforge train` on an
export of one dump of the same records, with the same steps, and served by SGLang with EAGLE-3:

    untrained      the draft config alone, weights from SGLang's dummy loader (the floor)
    ours           our bf16 dump of the EAGLE-3 layers (its seeds' spread is the run's noise)
    shifted        a dump of the layers one above, served with the config of the right ones (the
                   field's +1 trap; export_specforge --draft-config refuses it, which is recorded)
    fp8            our fp8 dump of the EAGLE-3 layers (exported dequantized)
    anchor         the same records' features from SpecForge's own in-process capture with
                   SGLang 0.5.14, upstream's tree (scripts/acceptance/specforge_capture.py):
                   ours must match it within the noise
    transformers   the same records' features from transformers' own forward of the target
                   (scripts/acceptance/reference_capture.py), SGLang nowhere on the path

A contender is named with its training seed: `ours-seed3`, `anchor-seed2` (a name without one,
`anchor`, is seed 1; `untrained` has none). `agreement`, named among the contenders, trains nothing: it makes our bf16 export and both
references' features of the same records and compares them sample by sample (tokens equal,
elements bit-equal, relative error), into OUT/acceptance.json's "agreement".

Every stage runs the real tool as a subprocess (generate, export_specforge, specforge train,
specforge export, SGLang's server); each contender's result, or the stage it failed at and why,
is appended to OUT/acceptance.json as soon as it is known, and each stage's log kept in OUT.
"""

import json
import os
import re
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from scripts.acceptance import data, measure, specforge_training
from scripts.acceptance.specforge_training import run_tool
from scripts.acceptance.target import NUM_LAYERS
from scripts.toolchain.errors import ToolError

# EAGLE-3's default layers for the target, [3, L//2+1, L-2], and the same one layer up.
LAYERS = [3, NUM_LAYERS // 2 + 1, NUM_LAYERS - 2]
DUMPS = {
    "bf16": {"layers": LAYERS, "dtype": None},
    "bf16-shifted": {"layers": [layer + 1 for layer in LAYERS], "dtype": None},
    "fp8": {"layers": LAYERS, "dtype": "fp8"},
}
TRAIN_TOKENS = 2_000_000
RECORD_TOKENS = 1024
PROMPTS = 64
PROMPT_TOKENS = 128
# SpecForge's trainer: the same for every contender but the seed.
TRAINING = {"strategy": "eagle3", "attention_backend": "sdpa", "batch_size": 8, "max_steps": 400,
            "learning_rate": 1e-3, "ttt_length": 7, "log_interval": 20, "save_interval": 0}
# The attention backend of every SGLang run here: the dump's, the anchor capture's, the server's.
ATTENTION_BACKEND = "triton"
STAGE_TIMEOUT_S = {"dump": 420, "export": 300, "capture": 420, "train": 300, "draft_export": 120}


@dataclass(frozen=True)
class Contender:
    dump: Optional[str]  # None: no training, dummy weights
    seed: Optional[int] = None


# Features made by another capture of the same records, not by a dump of ours.
SPECFORGE_CAPTURE, TRANSFORMERS_FORWARD = "specforge-capture", "transformers-forward"
REFERENCES = (SPECFORGE_CAPTURE, TRANSFORMERS_FORWARD)
AGREEMENT = "agreement"
AGREEMENT_SAMPLES = 256
# Each contender's features; a trained one is named `NAME` (seed 1) or `NAME-seedN`.
FEATURES = {"untrained": None, "ours": "bf16", "shifted": "bf16-shifted", "fp8": "fp8",
            "anchor": SPECFORGE_CAPTURE, "transformers": TRANSFORMERS_FORWARD}
SEEDED = re.compile(r"(?P<base>[a-z0-9]+)(?:-seed(?P<seed>[1-9][0-9]{0,5}))?")


def contender_named(name: str) -> Contender:
    """The contender `name` names: untrained, or a trained one with its seed (ours-seed2,
    anchor, anchor-seed3; ours needs its seed named, as the table's rows have it)."""
    match = SEEDED.fullmatch(name)
    base = match and match["base"]
    if base not in FEATURES or (base == "untrained" and match["seed"]) or (base == "ours" and not match["seed"]):
        raise ToolError(f"no contender {name}; the contenders are untrained, ours-seedN, and "
                        f"{', '.join(b for b in FEATURES if b not in ('untrained', 'ours'))} with an optional "
                        f"-seedN (seed 1 without one), and {AGREEMENT}")
    if base == "untrained":
        return Contender(None)
    return Contender(FEATURES[base], int(match["seed"] or 1))


def served_layer_ids() -> List[int]:
    """The draft config ids SGLang 0.5.14 feeds the layers LAYERS: its
    set_eagle3_layers_to_capture takes ids as they are unless the first is 1."""
    assert LAYERS[0] != 1
    return list(LAYERS)


class Pipeline:
    def __init__(self, target: Path, work: Path, out: Path):
        self.target, self.work, self.out = target, work, out
        self.results_path = out / "acceptance.json"
        import torch

        # The GPU the step ran on: acceptance compares across GPUs, tokens per second do not.
        self.results = {"target": str(target), "layers": LAYERS, "training": TRAINING,
                        "train_tokens": TRAIN_TOKENS, "contenders": {},
                        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
        self.exports: Dict[str, Path] = {}
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(target))._tokenizer
        self.prompts = data.held_out_prompts(self.tokenizer, PROMPTS, PROMPT_TOKENS)
        self.trainer_target = specforge_training.target_folder(target, work / "trainer-target")

    def save(self) -> None:
        self.results_path.write_text(json.dumps(self.results, indent=2) + "\n")

    def records(self) -> Path:
        path = self.work / "records.jsonl"
        if not path.exists():  # written whole, then named: a later step on a warm machine reuses it
            partial = path.with_suffix(".partial")
            self.results["records"] = data.write_train_records(self.tokenizer, partial, TRAIN_TOKENS, RECORD_TOKENS)
            partial.rename(path)
        return path

    def export(self, dump: str, config: Path) -> Path:
        """The dump `dump` of the records, made by generate, exported for SpecForge with
        --draft-config `config` (the draft config it is served with). For a dump of other
        layers than that config is fed, that export is refused: the refusal is recorded and the
        export made without the check, as a user who skipped it would (the +1 trap)."""
        if dump in self.exports:
            return self.exports[dump]
        spec = DUMPS[dump]
        dump_dir, export_dir = self.work / f"dump-{dump}", self.work / f"export-{dump}"
        if self.kept_features(dump, export_dir):
            return export_dir
        started = time.monotonic()
        args = [sys.executable, "-m", "scripts.dumps.generate", "--dataset", str(self.records()),
                "--out", str(dump_dir), "--model", str(self.target), "--concurrency", "64",
                "--dump-layers", ",".join(map(str, spec["layers"]))]
        if spec["dtype"]:
            args += ["--dump-dtype", spec["dtype"]]
        args += ["--", "--attention-backend", ATTENTION_BACKEND, "--sampling-backend", "pytorch", "--grammar-backend", "none",
                 "--disable-cuda-graph", "--mem-fraction-static", "0.3", "--max-total-tokens", "262144"]
        run_tool(args, self.out / f"generate-{dump}.log", STAGE_TIMEOUT_S["dump"])
        dumped = time.monotonic()
        export = [sys.executable, "-m", "scripts.dumps.export_specforge", str(dump_dir), str(export_dir)]
        record = {**spec, "dump_s": round(dumped - started, 1)}
        try:
            run_tool(export + ["--draft-config", str(config)], self.out / f"export-{dump}.log", STAGE_TIMEOUT_S["export"])
            record["draft_config_check"] = "accepted"
        except RuntimeError:
            if spec["layers"] == LAYERS:
                raise
            log = (self.out / f"export-{dump}.log").read_text(errors="replace").strip().splitlines()
            record["draft_config_check"] = f"refused: {log[-1] if log else '?'}"
            run_tool(export, self.out / f"export-{dump}-unchecked.log", STAGE_TIMEOUT_S["export"])
        record["export_s"] = round(time.monotonic() - dumped, 1)
        record["values"] = json.loads((export_dir / "draft_config_values.json").read_text())
        self.features_made(dump, export_dir, record)
        return export_dir

    def features_made(self, source: str, features: Path, record: dict) -> None:
        """Records `source`'s finished features, here and beside them in WORK, where a later
        step on the same machine finds them (kept_features)."""
        self.results.setdefault("dumps", {})[source] = record
        self.save()
        self.exports[source] = features
        (self.work / f"{features.name}.done.json").write_text(json.dumps(record) + "\n")

    def kept_features(self, source: str, features: Path) -> bool:
        """Whether an earlier step on this machine (a warm one keeps WORK) finished `source`'s
        features; a folder without its record is a step that stopped halfway, and is made again."""
        done = self.work / f"{features.name}.done.json"
        if not (done.exists() and features.is_dir()):
            return False
        self.results.setdefault("dumps", {})[source] = dict(json.loads(done.read_text()), kept_from_an_earlier_step=True)
        self.save()
        self.exports[source] = features
        return True

    def reference_features(self, source: str, config: Path) -> Path:
        """The features another capture makes of the records, in SpecForge's layout."""
        if source in self.exports:
            return self.exports[source]
        out = self.work / f"export-{source}"
        if self.kept_features(source, out):
            return out
        started = time.monotonic()
        if source == SPECFORGE_CAPTURE:
            record = specforge_capture(self.target, config, self.records(), out, self.out / f"capture-{source}.log")
        else:
            from scripts.acceptance import reference_capture

            record = reference_capture.capture(self.target, self.records(), out, LAYERS, RECORD_TOKENS)
        self.features_made(source, out, dict(record, capture_s=round(time.monotonic() - started, 1)))
        return out

    def agreement(self) -> None:
        """Our bf16 export against each reference's features of the same records."""
        from scripts.acceptance.agreement import compare, record_pairs

        config = specforge_training.draft_config(self.target, self.work / f"config-{AGREEMENT}", served_layer_ids())
        ours = self.export("bf16", config)
        pairs = record_pairs(ours, self.work / "dump-bf16")
        record = self.results.setdefault(AGREEMENT, {})
        for source in REFERENCES:
            try:
                record[source] = compare(ours, self.reference_features(source, config), AGREEMENT_SAMPLES, pairs)
            except Exception as e:
                record[source] = {"status": "failed", "error": f"{e}\n{traceback.format_exc(limit=3)}"[-4000:]}
                print(f"{AGREEMENT}: {source} failed: {e}", file=sys.stderr)
            self.save()

    def train(self, name: str, contender: Contender, features: Path, config: Path) -> Path:
        """SpecForge's trainer on `features`, then its export to a folder SGLang serves."""
        work = self.work / f"train-{name}"
        shutil.rmtree(work, ignore_errors=True)  # what a step stopped mid-training left on a warm machine
        run = specforge_training.run_config(name, self.trainer_target, config, features, work, RECORD_TOKENS,
                                            dict(TRAINING), contender.seed)
        specforge_training.train(run, self.out / f"train-{name}.log", STAGE_TIMEOUT_S["train"])
        return specforge_training.export_draft(work / "checkpoints", config, work / "draft",
                                               self.out / f"draft-export-{name}.log", STAGE_TIMEOUT_S["draft_export"])

    def run(self, name: str) -> None:
        contender = contender_named(name)
        result = {"dump": contender.dump, "seed": contender.seed}
        self.results["contenders"][name] = result
        started = time.monotonic()
        stage = "draft config"
        try:
            config = specforge_training.draft_config(self.target, self.work / f"config-{name}", served_layer_ids())
            if contender.dump is None:
                draft = config.parent
            else:
                stage = "dump and export"
                if contender.dump in REFERENCES:
                    features = self.reference_features(contender.dump, config)
                else:
                    features = self.export(contender.dump, config)
                stage = "specforge train"
                began = time.monotonic()
                draft = self.train(name, contender, features, config)
                result["train_s"] = round(time.monotonic() - began, 1)
            stage = "serve and measure"

            def measured_so_far(partial: dict) -> None:
                result.update(partial, status=f"measured {', '.join(partial['samplings'])}; measuring",
                              seconds=round(time.monotonic() - started, 1))
                self.save()

            result.update(measure.measure(self.target, draft, self.prompts, self.out / f"serve-{name}.log",
                                          dummy_weights=contender.dump is None, on_sampling=measured_so_far))
            result["status"] = "measured"
        except Exception as e:  # one contender's failure is recorded; the others still run
            result["status"] = f"failed at {stage}"
            result["error"] = f"{e}\n{traceback.format_exc(limit=3)}"[-4000:]
            print(f"{name}: failed at {stage}: {e}", file=sys.stderr)
        result["seconds"] = round(time.monotonic() - started, 1)
        self.save()


def specforge_capture(target: Path, config: Path, records: Path, out: Path, log: Path) -> dict:
    """scripts/acceptance/specforge_capture.py in a process of its own, on upstream SGLang when
    SGLANG_UPSTREAM names a folder holding the release's unpatched `sglang` package."""
    upstream = os.environ.get("SGLANG_UPSTREAM")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [upstream, os.environ.get("PYTHONPATH")]))}
    run_tool([sys.executable, "-m", "scripts.acceptance.specforge_capture", "--target", str(target),
              "--draft-config", str(config), "--records", str(records), "--out", str(out),
              "--max-tokens", str(RECORD_TOKENS), "--attention-backend", ATTENTION_BACKEND],
             log, STAGE_TIMEOUT_S["capture"], env)
    record = json.loads(log.read_text().strip().splitlines()[-1])
    record["sglang"] = "upstream" if upstream else "this project's patched tree, dumping off"
    return record


def run_pipeline(target: Path, work: Path, out: Path, names: List[str]) -> None:
    for name in names:  # every name checked before the first stage starts
        if name != AGREEMENT:
            contender_named(name)
    pipeline = Pipeline(target, work, out)
    for name in names:
        if name == AGREEMENT:
            pipeline.agreement()
            print(json.dumps({AGREEMENT: pipeline.results.get(AGREEMENT)}), flush=True)
            continue
        pipeline.run(name)
        print(json.dumps({name: {k: v for k, v in pipeline.results["contenders"][name].items()
                                 if k in ("status", "samplings", "train_s", "seconds")}}), flush=True)
