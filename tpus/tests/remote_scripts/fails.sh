#!/bin/sh
# Test script: reads its data, says why it gives up on stderr, and exits 3.
set -eu
cat >/dev/null
echo "working on it"
echo "some detail" >&2
echo "no such disk: pd-missing" >&2
exit 3
