"""The number users judge: acceptance of an EAGLE-3 draft trained only from our dump.

A small DeepSeek-V3 target trained on an offline corpus, the dump as a user runs it, SpecForge's
own trainer on the export, and SGLang serving each draft with EAGLE-3 (scripts/acceptance/run.py)."""
