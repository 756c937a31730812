from sglang.srt.models.kimi_k25 import EntryClass  # noqa: F401  Kimi-K2.5
