#!/bin/bash
# A counting py-spy for the benches (issue 22: where a heartbeat-less rank's py-spy CPU goes).
# Give it as the daemon's gil.pyspy_path; it runs the real py-spy and appends, per run, one line
#   <start epoch s> <parent pid> rc=<rc> <args>
# followed by the shell's `times` (its own and its children's user/sys CPU) to $LOG.
#   PYSPY_REAL=/path/py-spy PYSPY_LOG=/tmp/calls.log  (or edit the two defaults below)
REAL=${PYSPY_REAL:-/tmp/site/bin/py-spy}
LOG=${PYSPY_LOG:-/tmp/pyspy_calls.log}
t0=$(date +%s.%N)
"$REAL" "$@"
rc=$?
{ echo "$t0 $PPID rc=$rc $*"; times; } >> "$LOG"
exit $rc
