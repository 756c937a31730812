from sglang.srt.models.deepseek_v2 import EntryClass  # noqa: F401  DeepSeek-V2, V3, V3.2
