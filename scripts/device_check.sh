#!/usr/bin/env bash
# hlo-shard on an accelerator: one prepared check, at most 8 minutes on one GPU.
#
#   scripts/device_check.sh [--backend gpu|cpu] [--quick] [--out DIR] [--python PY]
#
# Runs in the checkout it belongs to. Writes DIR/report.md (DIR: --out, else $OUT,
# else ./device_check_out) with every step's figures or the reason it has none, and
# each step's log beside it. Steps (each under its own time limit; a step that fails
# or runs out is a row of the report, the others still run):
#
# 1. install: what is missing of jax (the jax[cuda12] wheel of the installed jax's
#    version on GPU), optax and hlo-shard itself, with pip;
# 2. verify: `hlo-shard optimize --force` then `hlo-shard verify --backend B` of the
#    SPMD fixtures that fit the devices. A fixture of N replicas runs one replica per
#    device, so it needs N devices: on CPU they are virtual (N forced host devices), on
#    GPU they are N GPUs. One GPU fits none (every fixture has N >= 2: a step on one
#    device has no gradient all-reduce to shard), and the report says so: on one GPU the
#    numerics of the rewrite are the CPU suite's, and this check is about the rest;
# 3. the jax step (scripts/device_check.py jax): whether XLA calls a registered pass on
#    this platform at all (a probe at both stages: where it is never called, install()
#    is a silent no-op with this jaxlib/plugin), then on the bench's update-heavy MLP +
#    Adam and the zoo's LayerNorm MLP + clip/AdamW: the train API
#    (shard_weight_update, state gathered and sharded) and install(), each against
#    plain jax.jit measured interleaved step by step on all local devices;
# 4. calibrate: `python -m hlo_shard.runtime.calibrate --backend B` (the GPU profile:
#    measured rates next to the published profile of that GPU in the report);
# 5. the report.
#
# --backend cpu runs the same steps on XLA CPU devices (2 with --quick), which is how
# tests/test_device_check.py shows the script works on a machine without a GPU.
# --quick: a few fixtures, small models, one calibration round.

set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
BACKEND=gpu
QUICK=0
DIR=${OUT:-$ROOT/device_check_out}
PY=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --backend) BACKEND=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --out) DIR=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    -h|--help) sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "device_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$BACKEND" in cpu|gpu) ;; *) echo "device_check.sh: --backend cpu or gpu, not $BACKEND" >&2; exit 2 ;; esac
mkdir -p "$DIR/verify" || exit 2
DIR=$(cd "$DIR" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
STARTED=$(date +%s)
# Time limits per step (seconds): 60 + 120 + 210 + 60 leave the report inside 8 minutes.
# (The install needs the package index; on a machine without one it fails in its 60 s
# and the steps run on what is installed.)
T_INSTALL=60; T_VERIFY=120; T_JAX=210; T_CALIBRATE=60
note() { echo "$*" >> "$DIR/notes.txt"; echo "device_check: $*"; }
: > "$DIR/notes.txt"

# 1. install -----------------------------------------------------------------------
if [ "$BACKEND" = cpu ]; then
  DEVICES=$([ $QUICK = 1 ] && echo 2 || echo 8)
  export JAX_PLATFORMS=cpu
  export XLA_FLAGS="--xla_force_host_platform_device_count=$DEVICES ${XLA_FLAGS:-}"
else
  unset JAX_PLATFORMS
  export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the runtime's worker and calibrate share the GPU
fi
{
  "$PY" -c "import hlo_shard, lark, networkx, click" 2>/dev/null \
    || timeout $T_INSTALL "$PY" -m pip install -q -e "$ROOT"
  "$PY" -c "import optax" 2>/dev/null || timeout $T_INSTALL "$PY" -m pip install -q optax
  if [ "$BACKEND" = gpu ] && ! "$PY" -c "import jax; jax.devices('gpu')" 2>/dev/null; then
    JAX_VERSION=$("$PY" -c "import jax; print(jax.__version__)" 2>/dev/null || echo 0.10.2)
    timeout $T_INSTALL "$PY" -m pip install -q "jax[cuda12]==$JAX_VERSION"
  fi
} > "$DIR/install.log" 2>&1 || note "install: failed or timed out (install.log)"
"$PY" - "$DIR" "$BACKEND" > "$DIR/environment.log" 2>&1 <<'EOF' || note "environment: jax does not start (environment.log)"
import json, subprocess, sys
from pathlib import Path
import jax, jaxlib.version
out, backend = Path(sys.argv[1]), sys.argv[2]
try:
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
except (OSError, subprocess.SubprocessError):
    smi = ""
devices = jax.devices("gpu" if backend == "gpu" else "cpu")
json.dump({"jax": jax.__version__, "jaxlib": jaxlib.version.__version__,
           "devices": len(devices), "device_kind": devices[0].device_kind,
           "gpus": [line for line in smi.splitlines() if line]},
          (out / "environment.json").open("w"))
print(len(devices))
EOF
DEVICES=$(tail -n 1 "$DIR/environment.log" | grep -E '^[0-9]+$' || echo 0)
note "$DEVICES $BACKEND device(s), $(( $(date +%s) - STARTED )) s in"
# A machine without a package index keeps the jax it has (an accelerator image's is often
# newer than the supported range): the check runs on it anyway, and the report says so.
UNSUPPORTED=$("$PY" -c "from hlo_shard.runtime._child import version_refusal
print(version_refusal() or '')" 2>/dev/null)
if [ -n "$UNSUPPORTED" ]; then
  export HLO_SHARD_ALLOW_UNSUPPORTED_JAX=1
  note "run with HLO_SHARD_ALLOW_UNSUPPORTED_JAX=1: ${UNSUPPORTED%%:*}"
fi

# 2. verify ------------------------------------------------------------------------
QUICK_FLAG=$([ $QUICK = 1 ] && echo --quick || true)
FIXTURES=$("$PY" scripts/device_check.py fixtures --devices "$DEVICES" $QUICK_FLAG)
if [ -z "$FIXTURES" ]; then
  echo "No fixture fits $DEVICES $BACKEND device(s): a fixture of N replicas needs N devices and every fixture has N >= 2 (a one-device step has no gradient all-reduce). The rewrite's numerics are checked by the CPU suite (verify on N virtual CPU devices); run this on a machine with 2, 4 or 8 GPUs to check them on GPU." > "$DIR/verify/NOTE"
else
  VERIFY_END=$(( $(date +%s) + T_VERIFY ))
  for fixture in $FIXTURES; do
    name=$(basename "$fixture" .hlo)
    left=$(( VERIFY_END - $(date +%s) ))
    if [ $left -le 5 ]; then echo "not run: the step's $T_VERIFY s were spent" > "$DIR/verify/$name.status"; continue; fi
    {
      timeout $left "$PY" -m hlo_shard optimize "$fixture" --force -o "$DIR/verify/$name.out.hlo" \
          --manifest "$DIR/verify/$name.out.json" \
        && timeout $(( VERIFY_END - $(date +%s) )) "$PY" -m hlo_shard verify "$fixture" "$DIR/verify/$name.out.hlo" \
             --manifest "$DIR/verify/$name.out.json" --backend "$BACKEND" --steps 2
    } > "$DIR/verify/$name.log" 2>&1
    echo "exit $?" > "$DIR/verify/$name.status"
  done
fi

# 3. the jax step --------------------------------------------------------------------
timeout $T_JAX "$PY" scripts/device_check.py jax --backend "$BACKEND" --out "$DIR" $QUICK_FLAG \
  > "$DIR/jax.log" 2>&1 || note "jax step: exit $? (jax.log; 124: its $T_JAX s ran out)"

# 4. calibrate -----------------------------------------------------------------------
# (GPU probes are a few milliseconds each: more runs cost seconds and steady the slope
# the bandwidths are read from)
if [ $QUICK = 1 ]; then
  RUNS="--runs 1 --rounds 1"
elif [ "$BACKEND" = cpu ]; then
  RUNS="--runs 5 --rounds 2"
else
  RUNS="--runs 10 --rounds 3"
fi
CALIBRATE="--backend $BACKEND --devices $DEVICES $RUNS"
timeout $T_CALIBRATE "$PY" -m hlo_shard.runtime.calibrate $CALIBRATE --output "$DIR/profile.json" \
  > "$DIR/calibrate.log" 2>&1 || note "calibrate: exit $? (calibrate.log)"

# 5. report --------------------------------------------------------------------------
note "all steps done in $(( $(date +%s) - STARTED )) s"
"$PY" scripts/device_check.py report --backend "$BACKEND" --out "$DIR" || exit 1
