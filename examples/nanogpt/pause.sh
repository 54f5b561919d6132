#!/bin/sh
# Pause or resume the long studies of this folder (study.py, time_to_target.py) while tests or a timing
# benchmark run:  sh examples/nanogpt/pause.sh stop | cont
# Signals each study process and every descendant: torchrun starts each rank in a session of its own, so
# signalling the study's process group alone leaves the ranks running. Keep a pause well under the ranks'
# process-group timeout (gloo's default, 30 min): a collective waiting across the pause may time out after it.
set -eu
case "${1:-}" in stop) sig=STOP ;; cont) sig=CONT ;; *) echo "usage: $0 stop|cont" >&2; exit 2 ;; esac
roots=$(pgrep -f 'examples/nanogpt/(study|time_to_target)\.py' || true)
[ -n "$roots" ] || { echo "no study running"; exit 0; }
all=""; frontier=$roots
while [ -n "$frontier" ]; do
  all="$all $frontier"; next=""
  for p in $frontier; do next="$next $(pgrep -P "$p" || true)"; done
  frontier=$(echo $next)
done
kill -s "$sig" $all
echo "$sig:$all"
