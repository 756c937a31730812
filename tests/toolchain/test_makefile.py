"""The Makefile: every target that runs SGLang goes through apply, so a stale checkout never runs."""

import re
from typing import Dict, List, Tuple

from scripts.paths import REPO_ROOT

# "target: prerequisites", once the "## help" text is cut off; not "VAR := value" or "VAR ?= value".
RULE = re.compile(r"^(?P<target>[^\s:=#]+)\s*:(?![:=])(?P<prerequisites>[^=]*)$")
# What puts the checkout on SGLang's path: the runtime environment, or the checkout itself.
RUNS_SGLANG = ("$(RUNTIME_ENV)", "$(CHECKOUT)")


def rules(makefile: str) -> Dict[str, Tuple[List[str], List[str]]]:
    """target -> (prerequisites, recipe lines) of every explicit rule."""
    found, target = {}, None
    for line in makefile.replace("\\\n", " ").splitlines():
        if line.startswith("\t") and target is not None:
            found[target][1].append(line.strip())
            continue
        match = RULE.match(line.split("##", 1)[0].rstrip())
        target = match["target"] if match else None
        if target is not None:
            found[target] = (match["prerequisites"].split(), [])
    return found


def running_sglang_without_apply(makefile: str) -> Tuple[List[str], List[str]]:
    """(targets whose recipe runs SGLang, those of them that do not depend on apply)."""
    running = sorted(target for target, (_, recipe) in rules(makefile).items()
                     if any(marker in line for line in recipe for marker in RUNS_SGLANG))
    return running, [target for target in running if "apply" not in rules(makefile)[target][0]]


def test_every_target_that_runs_sglang_depends_on_apply():
    running, without_apply = running_sglang_without_apply((REPO_ROOT / "Makefile").read_text())
    assert set(running) >= {"test-unit", "test-warmup", "test-server", "demo", "generate", "bench",
                            "bench-generate", "bench-writer", "bench-export"}
    assert without_apply == [], "these targets run SGLang without make apply's stale-checkout check"


def test_a_target_that_runs_sglang_without_apply_is_found():
    makefile = ("VERSION := 1\napply: tools ## a: b\n\t$(TOOLS_PY) -m scripts.toolchain apply\n"
                "demo: apply runtime ## the demo\n\t$(RUNTIME_ENV) $(RUNTIME_PY) -m scripts.dumps.demo\n"
                "sneaky: runtime ## runs the checkout\n\tPYTHONPATH=$(CHECKOUT) \\\n\t\tpython -m x\n")
    assert running_sglang_without_apply(makefile) == (["demo", "sneaky"], ["sneaky"])
