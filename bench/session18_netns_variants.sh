#!/usr/bin/env bash
# Issue 11 part 3, follow-up: acoll alone on the shaped namespaces (16 to 256 MiB) with
# settings that might fill the links better. OUT=dir NETBIN=.netbin bash bench/session18_netns_variants.sh
set -u
OUT=${OUT:-$PWD/session18_netns_variants}
mkdir -p "$OUT"
. bench/device_steps.sh
device_site
export PATH="$PWD/${NETBIN:-.netbin}:$PATH" CUDA_VISIBLE_DEVICES=
t0=$SECONDS
for v in "ACOLL_SOCKET_NSOCKS=1" "ACOLL_SOCKET_NSOCKS=2" "ACOLL_CHUNK_SIZE=2M" "ACOLL_SOCKET_SEND_THREADS=0"; do
  name=$(echo "$v" | tr '=' '_')
  timeout 200 python3 bench/netns_shaped.py --rate 10gbit -b 16M -e 256M -n 10 -w 3 --libs acoll \
    --acoll-env "$v" --out "$OUT/$name.txt" >"$OUT/$name.log" 2>&1
  echo "== $v: exit $? after $((SECONDS - t0)) s"
  grep -E "^ +[0-9]+ +[0-9.]+ +[0-9.]+%" "$OUT/$name.txt"
done
