"""Events (OOM kills, Xids, finding transitions): the ``Event`` type, the JSONL log and its sinks."""
