#!/usr/bin/env bash
# Time the stages of a long run and print them as one table, so that every note can quote them.
#   scripts/stage.sh run NAME COMMAND...   run COMMAND as stage NAME: "== NAME" before it, its
#                                          wall time and outcome after, a line in the times file
#   scripts/stage.sh table                 the table of the stages so far, and the total
# Sourced (`. scripts/stage.sh`), it defines the same two as the shell functions stage_run and
# stage_table, so that a stage can be a function of the sourcing script.
# The times file is $TESSERA_STAGE_TIMES, one "NAME<TAB>SECONDS<TAB>OUTCOME<TAB>START<TAB>END"
# line a stage; with none set, a stage is printed but not kept. Stages that overlap (a build in
# the background) are listed as they are; the total is the wall time from the first stage's start
# to the last one's end.

stage_run() {
  local name=$1 start end rc seconds outcome
  shift
  start=$(date +%s.%N)
  echo "== $name ($(date -u +%H:%M:%S))"
  rc=0
  "$@" || rc=$?
  end=$(date +%s.%N)
  seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.0f", b - a }')
  if [ "$rc" -eq 0 ]; then outcome=ok; else outcome="failed ($rc)"; fi
  echo "== $name: $seconds s, $outcome"
  if [ -n "${TESSERA_STAGE_TIMES:-}" ]; then
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$seconds" "$outcome" "$start" "$end" \
      >>"$TESSERA_STAGE_TIMES"
  fi
  return "$rc"
}

stage_table() {
  local times=${TESSERA_STAGE_TIMES:-}
  if [ -z "$times" ] || [ ! -s "$times" ]; then
    echo "(no stage times recorded)"
    return 0
  fi
  awk -F '\t' '
    { name[NR] = $1; secs[NR] = $2; outcome[NR] = $3
      if (NR == 1 || $4 < first) first = $4
      if (NR == 1 || $5 > last) last = $5
      if (length($1) > width) width = length($1) }
    END {
      if (width < 12) width = 12
      printf "\n%-*s  %7s  %s\n", width, "stage", "m:ss", "outcome"
      for (i = 1; i <= NR; i++)
        printf "%-*s  %4d:%02d  %s\n", width, name[i], secs[i] / 60, secs[i] % 60, outcome[i]
      total = last - first
      printf "%-*s  %4d:%02d  %s\n", width, "total (wall)", total / 60, total % 60, ""
    }' "$times"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -uo pipefail
  case ${1:-} in
    run)
      shift
      [ $# -ge 2 ] || { echo "usage: scripts/stage.sh run NAME COMMAND..." >&2; exit 2; }
      stage_run "$@"
      ;;
    table) stage_table ;;
    *)
      echo "usage: scripts/stage.sh run NAME COMMAND... | scripts/stage.sh table" >&2
      exit 2
      ;;
  esac
fi
