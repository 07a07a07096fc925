#!/bin/sh
# Test script: a lot on both streams at once, then its answer.
set -eu
head -c 3000000 /dev/zero | tr '\0' 'e' >&2
head -c 3000000 /dev/zero | tr '\0' 'o'
echo
echo "done=yes"
