#!/usr/bin/env bash
# The speed harness's GPU rows (leaderboard/PERF-gpu.md) in one call on a lent GPU machine, whose
# device time is short (15 minutes a session, the start included). Two halves:
#
#   here:  bash tools/perf_on_device.sh prepare
#          fills .device/ (git-ignored): the pinned wheels the machine lacks, Fashion-MNIST (no
#          clone: sweep_on_device.sh's would take the call over the 64 MiB that travels).
#   there: bash tools/perf_on_device.sh run [SET ...]   (carry .device; $OUT set)
#          SETs (default: these five, in this order): wrn256 (WRN-16-4, B 256 x augmult 16,
#          crop + flip, micro-batch 32; DP-SGD, RS, DP-SSGD, GIP, random-k, Nasr), mlp4096
#          (MLP 784-2048-2048-10, B 4096, micro-batch 512; the same methods), tanh4096 (tanh
#          CNN, B 4096, micro-batch 512, DP-SGD), wrn256-gep and mlp4096-gep (GEP and B-GEP at
#          those settings); on request wrn1024 (WRN-16-4, B 1024 x 1, micro-batch 128, DP-SGD).
#          Each set is JAX's non-private step against its pipelines, as `python -m
#          benchmarks.speed` measures them.
#
# Compiling a WRN step takes tens of seconds, one process at a time, and the harness runs
# every row in a fresh process, so the run is two phases sharing JAX's persistent compilation
# cache (/tmp/jaxcache): first every row is compiled and stepped once, PARALLEL processes at a
# time, PHASE1_S seconds at most (their step times are discarded: they share the GPU); then
# each SET's harness run times its rows one process at a time, each loading its step from the
# cache, until BUDGET_S seconds after the start. Reports: $OUT/<SET>.json (an unfinished set's
# report says where it stopped); their Markdown and every log in $OUT/logs.tar.gz. Then, when
# TRAIN_MIN_S (480) seconds of the budget are left, the training below.
#
#   there: bash tools/perf_on_device.sh profile [SET ...]   (default: wrn256 mlp4096 tanh4096)
#          where DP-SGD's step spends its time at each set's setting, per XLA operation
#          (benchmarks/profile_ops.py: 5 traced steps); $OUT/profile-<SET>.md.
#
#   there: bash tools/perf_on_device.sh train   (carry .device; $OUT set)
#          DP-SGD WRN-16-4 on Fashion-MNIST-32 at epsilon 3, B 256 x augmult 16, trained to its
#          end (TRAIN_EPOCHS epochs, default 10: about 5 minutes of steps on an H100) within
#          BUDGET_S seconds; $OUT/train-run_record.json, train-metrics.jsonl, train-config.gin,
#          train.log. A 30-epoch run (14 minutes of steps) does not fit one 10-minute call.
#
#   there: bash tools/perf_on_device.sh ab [SET ...]   (default: wrn256 mlp4096 tanh4096)
#          the step's speed knobs A/B'd in one call: `run` with DP-SGD only, once per VARIANT
#          (AB_VARIANTS, ';'-separated, each 'base', a gin binding or XLA_FLAGS=...; default:
#          base, train.branch_free_step, train.conv_grads 'convolution' and XLA's GPU command
#          buffers with conditionals and loops), BUDGET_S shared equally; every variant's run
#          has its own JAX non-private row, so each ratio has its own reference.
#          $OUT/ab.md (each variant's rows), ab-reports.tar.gz (their JSON), logs.tar.gz.
#
# PIPELINES (comma-separated) replaces each set's pipelines in run, e.g. PIPELINES=dpsgd.
# BINDING adds one gin binding to every row of run and profile (an A/B of a knob: e.g.
# BINDING='train.branch_free_step = True', the clipped sum without conditionals, or
# BINDING="train.conv_grads = 'convolution'", the WRN's per-example kernels without patches).
#
# SMOKE=1 shrinks every set (WRN-10-1 at B 16 x 2, a 32-32 MLP at B 256) for a CPU check of
# the script itself; PYTHON picks the interpreter (default python3) and SKIP_INSTALL=1 keeps the
# machine's own packages.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/device_env.sh  # WHEELS, device_fill, device_install

ALL_SETS=(wrn256 mlp4096 tanh4096 wrn256-gep mlp4096-gep)
PY="${PYTHON:-python3}"
COMMON=(--skip_torch --nocalibration --nomain_job --logical_batch=0 --nogep_floor
        --gep_refresh_every=0 --gep_paper_anchors=0 --interleaved_steps=0 --rounds=1
        --noise_multiplier=1.0 --config_timeout=300)

set_args() {  # the harness flags of one SET, into ARGS and PIPES (its pipelines)
  local wrn=(--model_gin=gin/model/wrn16_4.gin) mlp=(--model_gin=gin/model/mlp.gin)
  PIPES=(dpsgd rs dpssgd gip randomk nasr)
  case "$1" in  # BATCH and MICRO: B and the micro-batch size
    wrn256*) BATCH=256 MICRO=32 ARGS=("${wrn[@]}" --bindings=grad.per_example.augmult=16
                                      "--bindings=grad.per_example.augmentation='crop_flip'");;
    mlp4096*) BATCH=4096 MICRO=512 ARGS=("${mlp[@]}" "--bindings=model.hidden=(2048,2048)");;
    tanh4096) BATCH=4096 MICRO=512 ARGS=(); PIPES=(dpsgd);;
    wrn1024) BATCH=1024 MICRO=128 ARGS=("${wrn[@]}"); PIPES=(dpsgd);;
  esac
  case "$1" in
    wrn256|mlp4096|tanh4096|wrn1024) ;;
    wrn256-gep|mlp4096-gep) PIPES=(gep bgep);;  # apart: a GEP step can take seconds
    *) echo "unknown set $1 (known: ${ALL_SETS[*]} wrn1024)" >&2; exit 2;;
  esac
  TRAIN_ARGS=()
  if [ -n "${SMOKE:-}" ]; then  # later flags win: the same rows at test size
    case "$1" in
      wrn*) BATCH=16 MICRO=8 ARGS+=(--bindings=model.depth=10 --bindings=model.width=1
                                    "--bindings=grad.per_example.augmult=2");;
      *) BATCH=256 MICRO=64;;
    esac
    [[ "$1" == mlp4096* ]] && ARGS+=("--bindings=model.hidden=(32,32)")
    TRAIN_ARGS=("--gin_bindings=model.depth = 10" "--gin_bindings=model.width = 1"
                "--gin_bindings=train.batch_size = 16" "--gin_bindings=train.micro_batch_size = 8"
                "--gin_bindings=train.epochs = 0.01")
  fi
  [ -z "${PIPELINES:-}" ] || IFS=, read -ra PIPES <<< "$PIPELINES"
  SIZES=(--batch_sizes="$BATCH" --micro_batch_sizes="$MICRO")  # the harness's flags
  [ -z "${BINDING:-}" ] || ARGS+=("--bindings=$BINDING")  # one more gin binding, every row
  return 0
}

left() { echo $(( $1 - ($(date +%s) - START) )); }

train_wrn() {  # DP-SGD WRN-16-4 on Fashion-MNIST-32 at epsilon 3 to its end, within $1 seconds
  local wd epochs="${TRAIN_EPOCHS:-10}"
  echo "training: WRN-16-4, DP-SGD, B 256 x augmult 16, $epochs epochs${SMOKE:+ (SMOKE: WRN-10-1, B 16, 0.01 epochs)}, $1 s at most"
  wd=$(mktemp -d)/wrn16_4-dpsgd-eps3
  timeout "$1" "$PY" -m dpbench.main --gin_file=pipelines/dpsgd/pipeline.gin \
    --gin_file=gin/model/wrn16_4.gin "--gin_bindings=grad.per_example.augmult = 16" \
    "--gin_bindings=grad.per_example.augmentation = 'crop_flip'" \
    "--gin_bindings=train.batch_size = 256" "--gin_bindings=train.micro_batch_size = 32" \
    "--gin_bindings=train.epochs = $epochs" "${TRAIN_ARGS[@]}" \
    --workdir="$wd" > "$OUT/train.log" 2>&1 || echo "training stopped (exit $?): no record"
  for f in run_record.json metrics.jsonl config.gin; do
    [ ! -f "$wd/$f" ] || cp "$wd/$f" "$OUT/train-$f"
  done
}

setup() {  # there: the log, the packages, the compilation cache
  : "${OUT:?set OUT to the folder the reports go to}"
  START=$(date +%s)
  LOGS=$(mktemp -d)
  exec > >(tee "$LOGS/perf.log") 2>&1
  [ -n "${SKIP_INSTALL:-}" ] || device_install
  export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
}

case "${1:-}" in
prepare)
  device_fill
  du -sh .device
  ;;
run)
  shift
  sets=("$@"); [ "${#sets[@]}" -gt 0 ] || sets=("${ALL_SETS[@]}")
  for s in "${sets[@]}"; do set_args "$s"; done  # unknown names fail before any work
  setup
  budget="${BUDGET_S:-540}" phase1="${PHASE1_S:-230}" parallel="${PARALLEL:-5}" logs="$LOGS"
  echo "phase 1: every row compiled once, $parallel processes at a time"
  pids=()  # the phase's processes (a bare `wait` would also wait for the log's tee)
  for s in "${sets[@]}"; do
    set_args "$s"
    for p in "${PIPES[@]}"; do
      while [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do wait -n "${pids[@]}" 2>/dev/null || true; done
      t=$(left "$phase1"); [ "$t" -gt 5 ] || break 2
      # own allocations only, freed at once: the processes share the GPU's memory
      XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \
        timeout "$t" "$PY" -m benchmarks.speed "${COMMON[@]}" "${ARGS[@]}" "${SIZES[@]}" \
        --pipelines="$p" \
        --steps=1 --warmup=1 --out="$logs/warm-$s-$p.md" > "$logs/warm-$s-$p.log" 2>&1 &
      pids+=("$!")
    done
  done
  for pid in "${pids[@]}"; do wait "$pid" || true; done
  echo "phase 1 done at $(( $(date +%s) - START )) s"
  for s in "${sets[@]}"; do
    set_args "$s"
    t=$(left "$budget"); [ "$t" -gt 20 ] || { echo "no time left for $s"; break; }
    echo "phase 2: $s at $(( $(date +%s) - START )) s, $t s left"
    pipes=$(IFS=,; echo "${PIPES[*]}")
    timeout "$t" "$PY" -m benchmarks.speed "${COMMON[@]}" "${ARGS[@]}" "${SIZES[@]}" \
      --pipelines="$pipes" \
      --steps=10 --warmup=2 --out="$logs/$s.md" > "$logs/$s.log" 2>&1 \
      || echo "$s stopped early (exit $?): its report says how far it got"
    cp "$logs/$s.json" "$OUT/" 2>/dev/null || true  # at most 8 files come back
    grep -h "\] round\|ok:\|FAILED\|failed" "$logs/$s.log" || true  # each row, then its time
  done
  tar czf "$OUT/logs.tar.gz" -C "$logs" .
  t=$(left "$budget")
  if [ "$t" -ge "${TRAIN_MIN_S:-480}" ]; then train_wrn "$t"; else echo "no training: $t s left"; fi
  echo "done at $(( $(date +%s) - START )) s"
  ;;
profile)
  shift
  sets=("$@"); [ "${#sets[@]}" -gt 0 ] || sets=(wrn256 mlp4096 tanh4096)
  for s in "${sets[@]}"; do set_args "$s"; done
  setup
  for s in "${sets[@]}"; do
    set_args "$s"
    t=$(left "${BUDGET_S:-540}"); [ "$t" -gt 20 ] || { echo "no time left for $s"; break; }
    echo "profile: DP-SGD, $s, at $(( $(date +%s) - START )) s"
    timeout "$t" "$PY" -m benchmarks.profile_ops --pipeline=dpsgd "${ARGS[@]}" \
      --batch_size="$BATCH" --micro_batch_size="$MICRO" --steps=5 --warmup=2 --top=40 \
      > "$OUT/profile-$s.md" 2> "$LOGS/profile-$s.log" || echo "$s: profile failed (exit $?)"
    head -n 12 "$OUT/profile-$s.md"
  done
  tar czf "$OUT/logs.tar.gz" -C "$LOGS" .
  ;;
ab)
  shift
  sets=("$@"); [ "${#sets[@]}" -gt 0 ] || sets=(wrn256 mlp4096 tanh4096)
  for s in "${sets[@]}"; do set_args "$s"; done
  IFS=';' read -ra variants <<< "${AB_VARIANTS:-base;train.branch_free_step = True;train.conv_grads = 'convolution';XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE}"
  setup
  share=$(( (${BUDGET_S:-540} - ($(date +%s) - START)) / ${#variants[@]} ))
  reports=$(mktemp -d)
  for i in "${!variants[@]}"; do
    v="${variants[$i]}" sub="$reports/variant-$i"
    mkdir -p "$sub"
    echo "### variant $i: $v" | tee -a "$OUT/ab.md"
    binding="" flags="${XLA_FLAGS:-}"
    case "$v" in
      base) ;;
      XLA_FLAGS=*) flags="${v#XLA_FLAGS=}";;
      *) binding="$v";;
    esac
    OUT="$sub" SKIP_INSTALL=1 TRAIN_MIN_S=1000000 BUDGET_S="$share" \
      PHASE1_S=$(( share * 2 / 5 )) PIPELINES=dpsgd BINDING="$binding" XLA_FLAGS="$flags" \
      bash "$0" run "${sets[@]}" 2>&1 | tee "$LOGS/ab-variant-$i.log" \
      | grep -h "\] round\|ok:\|FAILED\|failed\|stopped\|no time" | tee -a "$OUT/ab.md" || true
  done
  tar czf "$OUT/ab-reports.tar.gz" -C "$reports" .
  tar czf "$OUT/logs.tar.gz" -C "$LOGS" .
  echo "done at $(( $(date +%s) - START )) s"
  ;;
train)
  set_args wrn256  # TRAIN_ARGS (SMOKE's sizes)
  setup
  train_wrn $(( ${BUDGET_S:-540} - ($(date +%s) - START) ))
  echo "done at $(( $(date +%s) - START )) s"
  ;;
*)
  echo "usage: $0 prepare | $0 run [SET ...] | $0 profile [SET ...] | $0 ab [SET ...] |" \
       "$0 train  (sets:" \
       "${ALL_SETS[*]})" >&2
  exit 2
  ;;
esac
