#!/bin/sh
# Pause or resume the long studies of this folder (study.py, time_to_target.py, regimes.py) while tests or a timing
# benchmark run:  sh examples/nanogpt/pause.sh stop | cont
# Signals each study process and every descendant: torchrun starts each rank in a session of its own, so
# signalling the study's process group alone leaves the ranks running. Keep a pause well under the ranks'
# process-group timeout (gloo's default, 30 min): a collective waiting across the pause may time out after it.
# The time paused counts in the runs' recorded wall time. Started with `nice -n 19`, the ranks stay niced under
# Linux's autogroup scheduling too: instrument.py gives each rank's session its niceness (nice_in_own_session).
set -u
case "${1:-}" in stop) sig=STOP ;; cont) sig=CONT ;; *) echo "usage: $0 stop|cont" >&2; exit 2 ;; esac
tree() {  # the studies' python processes and all their descendants
  frontier=$(pgrep -f 'python.*examples/nanogpt/(study|time_to_target|regimes)\.py' || true)
  out=""
  while [ -n "$frontier" ]; do
    out="$out $frontier"; next=""
    for p in $frontier; do next="$next $(pgrep -P "$p" || true)"; done
    frontier=$(echo $next)
  done
  echo $out
}
done_=""
for pass in 1 2 3; do  # again, for a rank or run started while the tree was being signalled
  new=""
  for p in $(tree); do case " $done_ " in *" $p "*) ;; *) new="$new $p" ;; esac; done
  [ -n "$new" ] || break
  for p in $new; do kill -s "$sig" "$p" 2>/dev/null || true; done
  done_="$done_$new"
done
[ -n "$done_" ] && echo "$sig:$done_" || echo "no study running"
