#!/bin/sh
# The shim's overhead, in one run against the same fake driver: medians, added cost and ratio.
# Run through `make -C shim bench`.  Figures on a loaded machine are noisy; medians damp that.
set -eu
cd "$(dirname "$0")/.."
B=$PWD/build
T=$(mktemp -d "${TMPDIR:-/tmp}/tessera-shim-bench.XXXXXX")
trap 'rm -rf "$T"' EXIT

# bench_ops without and with the shim, alternating ROUNDS times; each figure is the median of the rounds'
# medians (each round: 21 runs of 200000 calls).
ROUNDS=${ROUNDS:-5}
i=0
while [ $i -lt "$ROUNDS" ]; do
    env LD_LIBRARY_PATH="$B/fake" "$B/bench_ops" >>"$T/plain"
    env LD_LIBRARY_PATH="$B/fake" LD_PRELOAD="$B/libtessera.so" TESSERA_DEVICE_MEMORY_LIMIT_0=8192 \
        TESSERA_SHARED_REGION="$T/region" "$B/bench_ops" >>"$T/shim"
    # A low-priority container that nobody holds: every launch is counted and looks at the hold.
    env LD_LIBRARY_PATH="$B/fake" LD_PRELOAD="$B/libtessera.so" TESSERA_DEVICE_MEMORY_LIMIT_0=8192 \
        TESSERA_SHARED_REGION="$T/region-prio" TESSERA_TASK_PRIORITY=1 "$B/bench_ops" >>"$T/prio"
    i=$((i + 1))
done
med() { awk -v k="$2" '$1 == k { print $2 }' "$1" | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
plain=$(printf 'alloc_free_ns %s\nlaunch_ns %s\n' "$(med "$T/plain" alloc_free_ns)" "$(med "$T/plain" launch_ns)")
shim=$(printf 'alloc_free_ns %s\nlaunch_ns %s\n' "$(med "$T/shim" alloc_free_ns)" "$(med "$T/shim" launch_ns)")
start=$("$B/bench_start" "$B/bench_nop" "$B/libtessera.so" "$T/region-start")

get() { printf '%s\n' "$1" | awk -v k="$2" '$1 == k { print $2 }'; }

row() { # NAME UNIT PLAIN SHIM TARGET_ADDED
    awk -v n="$1" -v u="$2" -v a="$3" -v b="$4" -v t="$5" 'BEGIN {
        add = b - a; ok = (t == "" || add <= t) ? "ok" : "OVER";
        printf "%-44s %10.2f %10.2f %9.2f %7.2fx  %s\n", n " (" u ")", a, b, add, (a > 0 ? b / a : 0),
            (t == "" ? "" : "target +" t " " u ": " ok) }'
}

echo "tessera shim benchmark (fake driver; medians)"
printf '%-44s %10s %10s %9s %8s\n' "" "no shim" "shim" "added" "ratio"
row "cuMemAlloc_v2+cuMemFree_v2, limit set" ns "$(get "$plain" alloc_free_ns)" "$(get "$shim" alloc_free_ns)" 100
row "cuLaunchKernel, no compute limit" ns "$(get "$plain" launch_ns)" "$(get "$shim" launch_ns)" 20
row "cuLaunchKernel, task priority 1, not held" ns "$(get "$plain" launch_ns)" "$(med "$T/prio" launch_ns)" 20
row "start-up of a trivial program" us "$(get "$start" start_plain_us)" "$(get "$start" start_shim_us)" 5000
row "32 programs started at once, total" ms "$(get "$start" burst32_plain_ms)" "$(get "$start" burst32_shim_ms)" ""
awk -v b="$(get "$start" burst32_shim_ms)" 'BEGIN { printf "32 at once with the shim: %.2f ms in all (target <= 1000 ms: %s)\n", b, b <= 1000 ? "ok" : "OVER" }'
