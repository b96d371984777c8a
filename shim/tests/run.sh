#!/bin/sh
# The shim's tests: small programs, one behaviour each, run against the fake driver
# (build/fake/libcuda.so.1, build/fake/libnvidia-ml.so.1) with build/libtessera.so preloaded.
# Prints PASS/FAIL per test and, last, exactly "N passed, N failed"; exits 1 on any failure.
# Run through `make -C shim check [PYTHON=...]`, which builds everything first.
set -u
cd "$(dirname "$0")/.." || exit 2
B=$PWD/build
PY=${PYTHON:-python3}
T=$(mktemp -d "${TMPDIR:-/tmp}/tessera-shim-test.XXXXXX")
HOLDERS=""
cleanup() {
    for h in $HOLDERS; do kill -9 "$h" 2>/dev/null; done
    rm -rf "$T"
}
trap cleanup EXIT INT TERM

pass=0
fail=0
n=0

# t NAME CMD...: one test; passes when CMD exits 0.
t() {
    name=$1
    shift
    n=$((n + 1))
    REGION="$T/region.$n"
    if "$@" >"$T/out" 2>&1; then
        pass=$((pass + 1))
        echo "PASS $name"
    else
        fail=$((fail + 1))
        echo "FAIL $name"
        sed 's/^/    /' "$T/out"
    fi
}

# shim [VAR=VALUE...] CMD...: run with the shim, the fake driver and a 1024 MiB limit on device 0.
# shim_bg: the same in the background, as the very process $! names (so kill reaches it).
exec_shim() {
    exec env LD_PRELOAD="$B/libtessera.so" LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_MEM_MIB=16384 \
        TESSERA_SHARED_REGION="$REGION" TESSERA_DEVICE_MEMORY_LIMIT_0=1024 "$@"
}
shim() { (exec_shim "$@"); }
shim_bg() { exec_shim "$@" & }

# expect_err PATTERN: the last command's stderr ($T/err) holds PATTERN.
expect_err() {
    if grep -q -- "$1" "$T/err"; then return 0; fi
    echo "stderr lacks: $1"
    sed 's/^/    stderr: /' "$T/err"
    return 1
}

# wait_file PATH: wait up to 10 s for a holder to say it is ready.
wait_file() {
    i=0
    while [ ! -e "$1" ]; do
        i=$((i + 1))
        [ $i -gt 200 ] && { echo "timed out waiting for $1"; return 1; }
        sleep 0.05
    done
}

# hold MIB: start a process of the container that holds MIB; sets $HOLDER.
hold() {
    rm -f "$T/ready"
    shim_bg "$B/t_proc" hold "$1" "$T/ready"
    HOLDER=$!
    HOLDERS="$HOLDERS $HOLDER"
    wait_file "$T/ready"
}

echo "== the exported symbols are exactly hooks.def"
t "exports: nm -D libtessera.so == hooks.def" diff -u "$B/hooks.list" "$B/exports.list"

echo "== each interposition path: limit reported, allocation past it refused, free then allocate"
for c in report refuse realloc async; do
    t "linked -lcuda: $c" shim "$B/t_mem_linked" linked "$c"
done
for m in dlsym gpa1 gpa2 gpa2_ptds gpa_chain; do
    for c in report refuse realloc async; do
        t "$m: $c" shim "$B/t_mem_dl" "$m" "$c"
    done
done
for m in gpa1 gpa2 gpa2_ptds gpa_chain; do
    t "$m: the variant asked for (cudaVersion, per-thread stream) comes back hooked" \
        shim "$B/t_mem_dl" "$m" variants
done
for m in gpa1 gpa2 gpa2_ptds gpa_chain; do
    for c in refuse async variants; do
        t "$m, driver hands out internal addresses: $c" shim FAKE_CUDA_GPA_ALIASES=1 "$B/t_mem_dl" "$m" "$c"
    done
done
for c in report refuse realloc; do
    t "python ctypes: $c" shim "$PY" tests/t_ctypes.py "$c"
done
control() { ! env LD_LIBRARY_PATH="$B/fake" TESSERA_DEVICE_MEMORY_LIMIT_0=1024 "$B/t_mem_dl" dlsym refuse; }
t "control: without the shim the refusal test fails" control
t "dlsym(RTLD_NEXT) keeps its meaning" shim "$B/t_proc" dlnext

echo "== every allocation family"
for c in pitch managed async pool vmm vmm_host array array3d mipmap errno unknown_free; do
    t "family: $c" shim "$B/t_families" "$c"
done
t "family: async, driver without pool attributes" shim FAKE_CUDA_NO_POOL_ATTRS=1 "$B/t_families" pool_noattr
t "family: two devices, two limits" \
    shim FAKE_CUDA_DEVICES=2 TESSERA_DEVICE_MEMORY_LIMIT_1=256 "$B/t_families" multidev

echo "== virtual device memory: a 1024 MiB slice, 512 MiB resident, on a 768 MiB card"
OVER="FAKE_CUDA_MEM_MIB=768 TESSERA_DEVICE_MEMORY_RESIDENT_0=512"
for c in plain managed limit on_card totals free pitch; do
    t "oversubscribed: $c" shim $OVER "$B/t_oversub" "$c"
done
t "oversubscribed: a device without concurrent managed access refuses past the resident part" \
    shim $OVER FAKE_CUDA_CONCURRENT_MANAGED=0 "$B/t_oversub" no_access
over_two() {
    rm -f "$T/ready"
    (exec_shim $OVER "$B/t_proc" hold 400 "$T/ready") &
    h=$!
    HOLDERS="$HOLDERS $h"
    wait_file "$T/ready" || return 1
    shim $OVER "$B/t_oversub" second 400
    rc=$?
    kill -9 $h 2>/dev/null
    return $rc
}
t "oversubscribed: two processes of one container share the resident and the spilled counts" over_two
# Every slot taken: 63 by a live process (this script), slot 0 by a dead one that died in the
# middle of releasing spilled memory.  The newcomer reclaims slot 0 and must not inherit that
# unfinished release (its own spilled memory would then count as on the card).
over_reused_slot() {
    "$PY" -c 'import struct, sys
data = bytearray(21056)
struct.pack_into("<QIIQIII", data, 0, 0x3141524553534554, 3, 64, 21056, 16, 64, 64)
dead, alive = int(open("/proc/sys/kernel/pid_max").read()), int(sys.argv[2])
for i in range(64):
    struct.pack_into("<I", data, 576 + 320 * i, dead if i == 0 else alive)
struct.pack_into("<I", data, 576 + 144, 1)  # slot 0: spill_busy
open(sys.argv[1], "wb").write(data)' "$REGION" "$$" || return 1
    shim $OVER "$B/t_oversub" on_card
}
t "oversubscribed: a reclaimed slot does not inherit a dead process's unfinished release" over_reused_slot
t "oversubscribed: a resident part above the card is the card" \
    shim FAKE_CUDA_MEM_MIB=768 TESSERA_DEVICE_MEMORY_RESIDENT_0=1000 "$B/t_oversub" card
t "resident part equal to the limit: not oversubscribed" \
    shim TESSERA_DEVICE_MEMORY_RESIDENT_0=1024 "$B/t_oversub" plainall
for bad in abc 0 2000 -5; do
    bad_resident() {
        shim TESSERA_DEVICE_MEMORY_RESIDENT_0=$1 "$B/t_oversub" plainall 2>"$T/err" &&
            expect_err "TESSERA_DEVICE_MEMORY_RESIDENT_0='$1' is not a whole number of MiB from 1 to the limit"
    }
    t "bad resident part '$bad': said, and the slice is held on the card in full" bad_resident "$bad"
done

echo "== memory the card gives beyond allocations: contexts, modules, pools, graphs"
CTX="FAKE_CUDA_CTX_MIB=300"
t "context charged, refused past it, given back (NVML names the process)" shim $CTX "$B/t_driver" context
t "context charged (NVML answers with host pids: a pid namespace)" \
    shim $CTX FAKE_NVML_PID_OFFSET=100000 "$B/t_driver" context
t "context charged (no per-process figures: measured across the creation)" \
    shim $CTX FAKE_NVML_NO_PROCESSES=1 "$B/t_driver" context
t "cuCtxCreate / cuCtxDestroy charged and given back" shim $CTX "$B/t_driver" created
t "a noisy card-wide measure is corrected by NVML's per-process figure" \
    shim $CTX FAKE_NVML_DRIFT_MIB=50 "$B/t_driver" exact
t "the same through a pid namespace" shim $CTX FAKE_NVML_DRIFT_MIB=50 FAKE_NVML_PID_OFFSET=100000 "$B/t_driver" exact
t "without per-process figures the estimate errs high, never low" \
    shim $CTX FAKE_NVML_DRIFT_MIB=50 FAKE_NVML_NO_PROCESSES=1 "$B/t_driver" estimate
t "module and library loads charged, unloads given back" shim FAKE_CUDA_MODULE_MIB=100 "$B/t_driver" module
t "memory the driver takes unannounced is found before the slice overflows" \
    shim FAKE_CUDA_HIDDEN_MIB=200 "$B/t_driver" hidden
t "graph memory charged per new graph, given back by a trim" shim FAKE_CUDA_GRAPH_MIB=256 "$B/t_driver" graph
t "over the limit, a pool still serves its cache" shim FAKE_CUDA_HIDDEN_MIB=400 "$B/t_driver" cache_over

echo "== cards matched by identity: CUDA's order is not NVML's"
UUID0=GPU-7e55e2a0-0000-4000-8000-000000000000
UUID1=GPU-7e55e2a0-0000-4000-8000-000000000001
SWAPPED="FAKE_CUDA_DEVICES=2 CUDA_VISIBLE_DEVICES=$UUID1,$UUID0 TESSERA_DEVICE_MEMORY_LIMIT_1=256"
# CUDA ordinal 0 (1024 MiB) is NVML index 1; ordinal 1 (256 MiB) is NVML index 0.
# shellcheck disable=SC2086
t "NVML reports each card with its own limit (UUIDs from CUDA)" shim $SWAPPED "$B/t_devmap" cuda 256,1024
# shellcheck disable=SC2086
t "the same by PCI bus id when NVML has no UUIDs" shim $SWAPPED FAKE_NVML_NO_UUID=1 "$B/t_devmap" cuda 256,1024
# shellcheck disable=SC2086
t "the same in a process that never initialises CUDA (CUDA_VISIBLE_DEVICES)" \
    shim $SWAPPED "$B/t_devmap" nvml 256,1024
t "cards in PCI order: NVML index = ordinal" \
    shim FAKE_CUDA_DEVICES=2 TESSERA_DEVICE_MEMORY_LIMIT_1=256 "$B/t_devmap" nvml 1024,256
# shellcheck disable=SC2086
t "pynvml sees each card with its own limit" shim $SWAPPED "$PY" "$PWD/tests/t_pynvml.py" 1024 0 1
# shellcheck disable=SC2086
t "the compute limit reads the utilisation of its own card" \
    shim $SWAPPED FAKE_NVML_UTIL=model FAKE_KERNEL_US=1000 TESSERA_DEVICE_CORE_LIMIT_0=30 "$B/t_compute" 30 3

echo "== processes of one container"
share() {
    hold 600 || return 1
    shim "$B/t_proc" alloc 600 oom && shim "$B/t_proc" alloc 400 ok && shim "$B/t_proc" report 1024 424
    rc=$?
    kill "$HOLDER" # SIGTERM: no destructor runs, like a crash
    wait "$HOLDER" 2>/dev/null
    [ $rc -eq 0 ] && shim "$B/t_proc" report 1024 1024 # reported usage drops the dead at once
}
t "two processes share one limit" share
sigkill() {
    hold 800 || return 1
    shim "$B/t_proc" alloc 800 oom || return 1
    kill -9 "$HOLDER"
    wait "$HOLDER" 2>/dev/null
    shim "$B/t_proc" alloc 800 ok && shim "$B/t_proc" report 1024 1024
}
t "a SIGKILLed holder's memory returns" sigkill
zombie() {
    hold 800 || return 1
    kill -9 "$HOLDER" # not waited for: a zombie still answers kill(pid, 0)
    sleep 0.1
    shim "$B/t_proc" alloc 800 ok
}
t "a killed holder not yet reaped (zombie) does not keep its memory" zombie
churn() {
    pids=""
    for i in 1 2 3 4; do
        rm -f "$T/churn$i"
        shim_bg "$B/t_proc" churn "$T/churn$i"
        pids="$pids $!"
        HOLDERS="$HOLDERS $!"
    done
    for i in 1 2 3 4; do wait_file "$T/churn$i" || return 1; done
    sleep 0.3
    for p in $pids; do kill -9 "$p"; done
    for p in $pids; do wait "$p" 2>/dev/null; done
    shim "$B/t_proc" alloc 1024 ok # all of it: nothing stuck, no lock left held
}
t "processes killed mid-allocation leave no lock and no count behind" churn
t "exec() drops the old image's count" shim "$B/t_proc" execself 600

echo "== NVML"
pynvml_slice() {
    hold 256 || return 1
    shim "$PY" "$PWD/tests/t_pynvml.py" 1024 256
    rc=$?
    kill "$HOLDER"
    wait "$HOLDER" 2>/dev/null
    return $rc
}
t "unmodified pynvml sees the slice ($PY)" pynvml_slice

echo "== compute"
for c in "converge 10" "converge 30" "converge 70" light floor burst; do
    # shellcheck disable=SC2086
    t "limiter (virtual clock): $c" "$B/t_limiter" $c
done
t "launches held to 30% against fake NVML utilisation" \
    shim FAKE_NVML_UTIL=model FAKE_KERNEL_US=1000 TESSERA_DEVICE_CORE_LIMIT_0=30 "$B/t_compute" 30 3
t "no compute limit: launches are not held" \
    shim FAKE_NVML_UTIL=model FAKE_KERNEL_US=1000 "$B/t_compute" 0 1
two_tenants() {
    # Two containers on one card (one card state, two regions), at 30 % and 60 %: each is held
    # to its own share, measured by its own per-process samples, not the card's total.
    env_common="FAKE_NVML_UTIL=model FAKE_KERNEL_US=1000 FAKE_GPU_STATE=$T/card.$n"
    # shellcheck disable=SC2086
    (exec_shim $env_common TESSERA_SHARED_REGION="$T/a.$n" TESSERA_DEVICE_CORE_LIMIT_0=30 \
        "$B/t_compute" 30 4 ctx) >"$T/a.out" 2>&1 &
    a=$!
    # shellcheck disable=SC2086
    (exec_shim $env_common TESSERA_SHARED_REGION="$T/b.$n" TESSERA_DEVICE_CORE_LIMIT_0=60 \
        "$B/t_compute" 60 4 ctx) >"$T/b.out" 2>&1 &
    b=$!
    wait $a
    ra=$?
    wait $b
    rb=$?
    cat "$T/a.out" "$T/b.out"
    [ $ra -eq 0 ] && [ $rb -eq 0 ]
}
t "two containers at 30 % and 60 % on one card each get their own share" two_tenants

echo "== task priority: launches counted, a hold from the node plugin honoured"
t "launches are counted per device" shim TESSERA_TASK_PRIORITY=1 FAKE_CUDA_DEVICES=2 "$B/t_priority" count
t "no priority: nothing counted, a hold changes nothing" shim "$B/t_priority" uncounted
t "a held launch waits until the hold is lifted, errno kept" shim TESSERA_TASK_PRIORITY=1 "$B/t_priority" held
t "a hold nobody renews (plugin gone) runs out" shim TESSERA_TASK_PRIORITY=1 "$B/t_priority" stale
t "a hold whose lease has run out holds nothing" shim TESSERA_TASK_PRIORITY=1 "$B/t_priority" expired
t "a lease longer than the plugin gives holds nothing" shim TESSERA_TASK_PRIORITY=1 "$B/t_priority" bogus
t "priority 0 is never held, and is counted" shim TESSERA_TASK_PRIORITY=0 "$B/t_priority" top
t "a hold on device 1 leaves device 0 alone" \
    shim TESSERA_TASK_PRIORITY=1 FAKE_CUDA_DEVICES=2 "$B/t_priority" other_device
t "a priority keeps its own compute limit" \
    shim FAKE_NVML_UTIL=model FAKE_KERNEL_US=1000 TESSERA_DEVICE_CORE_LIMIT_0=30 TESSERA_TASK_PRIORITY=0 \
    "$B/t_compute" 30 3
priority_only() {
    # A priority without any limit still gets a region: the node plugin needs the counts.
    env LD_PRELOAD="$B/libtessera.so" LD_LIBRARY_PATH="$B/fake" TESSERA_SHARED_REGION="$REGION" \
        TESSERA_TASK_PRIORITY=1 "$B/t_priority" held
}
t "a priority alone (no limit) is honoured" priority_only

echo "== task priority across containers: real shims, the node plugin's monitor"
t "a low-priority container yields while a high one on its card is busy, and resumes" \
    "$PY" tests/t_priority_cards.py yield
t "a high-priority container is never held for low-priority work" "$PY" tests/t_priority_cards.py high
t "containers on different cards do not hold each other" "$PY" tests/t_priority_cards.py cards
t "a dead monitor's hold runs out" "$PY" tests/t_priority_cards.py stale
t "a container without a priority takes no part" "$PY" tests/t_priority_cards.py unset

echo "== bad settings: a message at load, a safe behaviour, never a crash"
bad_number() {
    shim TESSERA_DEVICE_MEMORY_LIMIT_0=abc "$B/t_proc" alloc 2000 ok 2>"$T/err" &&
        expect_err "TESSERA_DEVICE_MEMORY_LIMIT_0='abc' is not a whole number of MiB; device 0 has NO memory limit"
}
t "non-numeric limit: message, no limit on that device" bad_number
negative() {
    shim TESSERA_DEVICE_MEMORY_LIMIT_0=-5 "$B/t_proc" alloc 2000 ok 2>"$T/err" &&
        expect_err "TESSERA_DEVICE_MEMORY_LIMIT_0='-5' is not a whole number"
}
t "negative limit: message, no limit on that device" negative
above_card() {
    shim TESSERA_DEVICE_MEMORY_LIMIT_0=99999 "$B/t_proc" report 16384 16384 2>"$T/err" &&
        expect_err "TESSERA_DEVICE_MEMORY_LIMIT_0=99999 MiB exceeds the card's 16384 MiB; using the card's size"
}
t "limit above the card: message, held to the card" above_card
missing_region() {
    shim TESSERA_SHARED_REGION="$T/no/such/dir/region" "$B/t_proc" alloc 2000 oom 2>"$T/err" &&
        expect_err "cannot be opened for writing (No such file or directory); memory is counted per process"
}
t "missing region directory: message, per-process limit" missing_region
unwritable_region() {
    shim TESSERA_SHARED_REGION=/proc/version "$B/t_proc" alloc 2000 oom 2>"$T/err" &&
        expect_err "TESSERA_SHARED_REGION=/proc/version" && expect_err "memory is counted per process"
}
t "unwritable region: message, per-process limit" unwritable_region
dir_region() {
    mkdir -p "$T/adir"
    shim TESSERA_SHARED_REGION="$T/adir" "$B/t_proc" alloc 2000 oom 2>"$T/err" &&
        expect_err "memory is counted per process"
}
t "region path is a directory: message, per-process limit" dir_region
other_version() {
    "$PY" -c 'import struct, sys
data = bytearray(21056)
struct.pack_into("<QII", data, 0, 0x3141524553534554, 99, 64)
open(sys.argv[1], "wb").write(data)' "$T/v99" || return 1
    cp "$T/v99" "$T/v99.orig"
    shim TESSERA_SHARED_REGION="$T/v99" "$B/t_proc" alloc 2000 oom 2>"$T/err" &&
        expect_err "is a version 99 region, this shim uses version 3; it is left as it is" &&
        cmp "$T/v99" "$T/v99.orig"
}
t "region from another version: message, untouched, per-process limit" other_version
not_region() {
    printf 'hello world\n' >"$T/junk"
    shim TESSERA_SHARED_REGION="$T/junk" "$B/t_proc" alloc 2000 oom 2>"$T/err" &&
        expect_err "is not a Tessera region" && [ "$(cat "$T/junk")" = "hello world" ]
}
t "a file that is not a region: message, untouched" not_region
interrupted_creation() {
    head -c 21056 /dev/zero >"$REGION" # sized, header never written: its creator died
    shim "$B/t_proc" alloc 600 ok && shim "$B/t_proc" report 1024 1024 &&
        "$PY" -c 'import struct, sys; m, v = struct.unpack_from("<QI", open(sys.argv[1], "rb").read());
sys.exit(0 if (m, v) == (0x3141524553534554, 3) else 1)' "$REGION"
}
t "a region whose creator died half-way is finished and used" interrupted_creation
device_out_of_range() {
    shim TESSERA_DEVICE_MEMORY_LIMIT_16=5 "$B/t_proc" alloc 10 ok 2>"$T/err" &&
        expect_err "TESSERA_DEVICE_MEMORY_LIMIT_16: only devices 0-15 can be limited; ignored"
}
t "limit for a device past 15: message, ignored" device_out_of_range
no_region_setting() {
    env LD_PRELOAD="$B/libtessera.so" TESSERA_DEVICE_MEMORY_LIMIT_0=1024 "$B/t_proc" alloc 2000 oom 2>"$T/err" &&
        expect_err "TESSERA_SHARED_REGION is not set"
}
t "no region configured: warning, per-process limit" no_region_setting
config_file() {
    printf '# written by the node plugin\nTESSERA_DEVICE_MEMORY_LIMIT_0 = 512\nTESSERA_SHARED_REGION=%s\n' \
        "$T/cfg-region" >"$T/cfg"
    env LD_PRELOAD="$B/libtessera.so" TESSERA_CONFIG="$T/cfg" "$B/t_proc" report 512 512 &&
        [ -s "$T/cfg-region" ]
}
t "TESSERA_CONFIG file: limits and region from the file" config_file
config_env_wins() {
    printf 'TESSERA_DEVICE_MEMORY_LIMIT_0=512\n' >"$T/cfg2"
    shim TESSERA_CONFIG="$T/cfg2" "$B/t_proc" report 1024 1024
}
t "TESSERA_CONFIG: the environment wins over the file" config_env_wins
config_missing() {
    shim TESSERA_CONFIG="$T/none.conf" "$B/t_proc" alloc 2000 oom 2>"$T/err" &&
        expect_err "TESSERA_CONFIG=$T/none.conf cannot be read"
}
t "missing TESSERA_CONFIG file: message, environment still used" config_missing
bad_core() {
    shim TESSERA_DEVICE_CORE_LIMIT_0=150 "$B/t_proc" alloc 10 ok 2>"$T/err" &&
        expect_err "TESSERA_DEVICE_CORE_LIMIT_0='150' is not a percentage 0-100; device 0 has NO compute limit"
}
t "core limit above 100: message, no compute limit" bad_core
bad_priority() {
    for v in 7 abc -1; do
        shim TESSERA_TASK_PRIORITY=$v "$B/t_priority" uncounted 2>"$T/err" &&
            expect_err "TESSERA_TASK_PRIORITY='$v' is not a priority 0-1 (0 = high, 1 = low); this container takes NO part in priorities" ||
            return 1
    done
}
t "task priority not 0-1: message, no part in priorities" bad_priority
bad_log_level() {
    shim TESSERA_LOG_LEVEL=loud "$B/t_proc" alloc 10 ok 2>"$T/err" && expect_err "TESSERA_LOG_LEVEL='loud'"
}
t "bad log level: message, default level" bad_log_level
quiet() {
    shim TESSERA_LOG_LEVEL=off TESSERA_DEVICE_MEMORY_LIMIT_0=abc "$B/t_proc" alloc 10 ok 2>"$T/err" && [ ! -s "$T/err" ]
}
t "TESSERA_LOG_LEVEL=off: silent" quiet
unconfigured() {
    env LD_PRELOAD="$B/libtessera.so" LD_LIBRARY_PATH="$B/fake" "$B/t_proc" alloc 8000 ok 2>"$T/err" && [ ! -s "$T/err" ]
}
t "no settings at all: pass-through, silent" unconfigured

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
