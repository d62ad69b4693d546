#!/bin/bash
# every thread of each swarm-client trainer at nice 10; its helpers (DHT, averager) and their p2pd at 0
while true; do
  for pid in $(pgrep -f "client.cli"); do
    ppid=$(ps -o ppid= -p $pid 2>/dev/null | tr -d ' ')
    [ -z "$ppid" ] && continue
    if tr '\0' ' ' < /proc/$ppid/cmdline 2>/dev/null | grep -q "client.cli"; then n=0; else n=10; fi
    for t in /proc/$pid/task/*; do renice -n $n -p ${t##*/} >/dev/null 2>&1; done
  done
  for pid in $(pgrep p2pd); do for t in /proc/$pid/task/*; do renice -n 0 -p ${t##*/} >/dev/null 2>&1; done; done
  sleep 0.3
done
