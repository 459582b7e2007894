# The GPU check's stages, each its own process (sourced by gpu_check.sh).
#
# A CUDA error is sticky: once a kernel faults, every later call in that
# process fails too, and an asynchronous fault is reported by whatever call
# happens to come next. So each stage runs alone: a stage that fails or
# crashes leaves the others' results, and it is run once more with
# CUDA_LAUNCH_BLOCKING=1, so that the rerun names the launch that faulted
# (not one that timed out: a hang hangs again).
# The summary table at the end says, for every stage, what came of it.
#
# The whole check keeps within GPU_CHECK_BUDGET_S (default 280 s, so that
# a second run fits in a short loan): a stage's limit is cut to what is
# left, a rerun happens only while time is left, and a stage with no time
# left is skipped, says so, and makes the check fail (incomplete).
#
#   stage NAME LIMIT_S COMMAND...   run one stage (its output as it comes)
#   summary                         print the table. GPU_CHECK_STATUS is
#                                   0 all passed, 2 no GPU, 1 anything else
#                                   (a failure, or a stage out of time)

GPU_STAGE_ROWS=()
GPU_CHECK_STATUS=0
GPU_CHECK_DEADLINE=$(( $(date +%s) + ${GPU_CHECK_BUDGET_S:-280} ))

# Seconds a stage may take: its own limit, or what is left of the budget.
gpu_stage_limit() {
  local left=$(( GPU_CHECK_DEADLINE - $(date +%s) ))
  if [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}

# What an exit status says.
gpu_stage_verdict() {
  case "$1" in
    0) echo "pass" ;;
    1) echo "FAIL (mismatch)" ;;
    2) echo "no GPU" ;;
    3) echo "FAIL (CUDA error)" ;;
    124) echo "FAIL (timed out)" ;;
    *) if [ "$1" -gt 128 ]; then echo "FAIL (crashed, signal $(($1 - 128)))"; else echo "FAIL (exit $1)"; fi ;;
  esac
}

stage() {
  local name="$1" limit
  limit=$(gpu_stage_limit "$2")
  shift 2
  if [ "$limit" -lt 5 ]; then
    # Not run is not passed: the check is incomplete.
    GPU_STAGE_ROWS+=("| $name | skipped: out of time (GPU_CHECK_BUDGET_S) | 0 | - |")
    GPU_CHECK_STATUS=1
    return
  fi
  echo
  echo "== stage $name: $*"
  local t0 s=0 rerun="-"
  t0=$(date +%s.%N)
  timeout "$limit" "$@" || s=$?
  local secs
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  if [ "$s" -eq 124 ]; then
    # A hang hangs again with blocking launches: its time goes to the
    # stages after it instead.
    rerun="not rerun: timed out"
  elif [ "$s" -ne 0 ] && [ "$s" -ne 2 ]; then
    local again
    again=$(gpu_stage_limit "$limit")
    if [ "$again" -ge 5 ]; then
      echo "== stage $name: $(gpu_stage_verdict "$s"); again with CUDA_LAUNCH_BLOCKING=1"
      local r=0
      CUDA_LAUNCH_BLOCKING=1 timeout "$again" "$@" || r=$?
      rerun=$(gpu_stage_verdict "$r")
    else
      rerun="not run: out of time"
    fi
  fi
  GPU_STAGE_ROWS+=("| $name | $(gpu_stage_verdict "$s") | $secs | $rerun |")
  if [ "$s" -ne 0 ] && [ "$s" -ne 2 ]; then
    GPU_CHECK_STATUS=1
  elif [ "$s" -eq 2 ] && [ "$GPU_CHECK_STATUS" -eq 0 ]; then
    GPU_CHECK_STATUS=2
  fi
}

summary() {
  echo
  echo "| stage | result | seconds | rerun with CUDA_LAUNCH_BLOCKING=1 |"
  echo "|---|---|---|---|"
  local row
  for row in "${GPU_STAGE_ROWS[@]}"; do
    echo "$row"
  done
}

# A stage that cannot run here, and why (not a failure).
skip() {
  GPU_STAGE_ROWS+=("| $1 | skipped: $2 | 0 | - |")
}
