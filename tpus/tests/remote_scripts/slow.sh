#!/bin/sh
# Test script: takes longer than the tests allow scripts to run.
set -eu
sleep 30
