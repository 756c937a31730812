"""The model classes the test servers serve, as SGLang's registry takes an external package
(SGLANG_EXTERNAL_MODEL_PACKAGE, set in tests/server/conftest.py from 0.5.23 on): each module's
`EntryClass`, the classes SGLang's own modules register. A server process then imports these
two model modules instead of every one SGLang has (7 CPU-seconds of each process's start on
this CPU, against about 20 for the rest of its imports); an architecture not listed here makes
the registry import them all, as it does without the setting."""
