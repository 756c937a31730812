"""The patch toolchain: sglang.lock, the pinned checkouts, the series, and the operations on a
tree (verify, apply, revert, refresh-patches)."""
