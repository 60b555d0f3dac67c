"""The join: one cycle's readings plus explicit memory (orphans, stalls, kernel events, Xid dedup,
rank claims, memory growth) -> an immutable ``NodeState`` (join.state). Pure: no I/O of its own
beyond what a module's docstring says.
"""
