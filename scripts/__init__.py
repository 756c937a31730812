"""This project's tools, in three wings: toolchain/ pins SGLang releases and applies the patch
series, dumps/ runs a dumping server and reads, checks and exports what it writes, bench/
measures what dumping costs."""
