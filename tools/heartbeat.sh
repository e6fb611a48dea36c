#!/bin/sh
# heartbeat.sh COMMAND...: run COMMAND; when stdout is not a terminal (a CI log, `make demo |
# tee`), say every 10 s that it is still running, so a long silent step (pip unpacking
# torch, say) is not mistaken for a hang. On a terminal the command's own progress shows.
[ -t 1 ] && exec "$@"
"$@" &
pid=$!
n=0
while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    n=$((n + 1))
    if [ $((n % 10)) -eq 0 ] && kill -0 "$pid" 2>/dev/null; then
        echo "  ... still running after ${n}s"
    fi
done
wait "$pid"
