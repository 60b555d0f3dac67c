"""``state_dir/job_owners.json``: which uid owns each job that has ranks on this node (trust rule 2,
``join/rank_claims.py``), kept across restarts of the daemon.

A job's owner is decided once, by the first trusted claim the daemon sees, and kept while the job
has ranks. Without this file a restart would decide again from the processes' start times, and an
older process of another user that claims the job (a rank file naming its own ``sleep``) would
take it: the job's real ranks refused, its pages gone. The daemon writes the file when the owner
map changes (a job starts or ends, not every cycle) and reads it once at start-up.

What is read back is untrusted input (a crash, a disk error, a hand edit): at most
``MAX_FILE_BYTES``, at most ``MAX_RANKS_PER_NODE`` jobs, each job id as a rank file's and each uid
a 32-bit integer; anything else is skipped (counted in
``gpuwatch_state_records_rejected_total{file="job_owners.json"}``) and the daemon starts with what
is valid. Cost: one small read at start, one atomic write per change of the map. Privilege:
write access to ``state_dir``. Shell equivalent: ``cat /var/lib/gpuwatchd/job_owners.json``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping

from gpuwatchd.rank.rankfile import JOB_ID_RE, MAX_RANKS_PER_NODE, loads_strict
from gpuwatchd.statefile import StateFiles, read_capped

log = logging.getLogger(__name__)

FILE = "job_owners.json"
MAX_FILE_BYTES = 256 * 1024  # 1024 jobs of 128-character ids and their uids fit in 140 KiB


class JobOwnerFile:
    """Loads the owner map once; ``save`` writes it when it differs from what is on disk."""

    def __init__(self, state_dir: str, files: StateFiles) -> None:
        self.path = os.path.join(state_dir, FILE)
        self.files = files
        self._saved: dict[str, int] | None = None

    def load(self) -> dict[str, int]:
        try:
            raw = read_capped(self.path, MAX_FILE_BYTES)
        except FileNotFoundError:
            self._saved = {}
            return {}
        except OSError as e:
            log.warning("cannot read %s (%s): job owners are decided again", self.path, e.strerror)
            return {}
        owners: dict[str, int] = {}
        try:
            if len(raw) > MAX_FILE_BYTES:
                raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
            doc = loads_strict(raw.decode("utf-8"))  # numbers of at most 24 characters
            items = doc.get("owners") if isinstance(doc, dict) else None
            if not isinstance(items, dict):
                raise ValueError("no owners object")
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            self.files.rejected(self.path, "unreadable")
            log.warning("%s is not usable (%.80s): job owners are decided again", self.path, e)
            return {}
        for job, uid in items.items():
            if (
                len(owners) >= MAX_RANKS_PER_NODE
                or not JOB_ID_RE.match(job)
                or type(uid) is not int
                or not 0 <= uid < 1 << 32
            ):
                self.files.rejected(self.path, "invalid")
                continue
            owners[job] = uid
        self._saved = dict(owners)
        return owners

    def save(self, owners: Mapping[str, int]) -> None:
        if self._saved is not None and dict(owners) == self._saved:
            return
        text = json.dumps({"version": 1, "owners": dict(sorted(owners.items()))}, indent=0)
        if self.files.write(self.path, text + "\n"):
            self._saved = dict(owners)
