#!/usr/bin/env bash
# launch/pipe.sh — start pipeengine's trainer on N processes with torchrun.
#
#   launch/pipe.sh N gpus|cpus [--pp P] [trainer flags...]
#
#   N        processes on this node (one per GPU for "gpus")
#   gpus     NCCL backend, device cuda (one process per GPU)
#   cpus     Gloo backend, device cpu; the node's cores are split fairly: OMP_NUM_THREADS=cores/N
#   --max-restarts N   torchrun restarts all workers up to N times after a failure (default 0, env MAX_RESTARTS)
#   --pp P   pipeline stages; dp = world / P. Default: pp = N/2 (at most 8) for even N >= 4,
#            otherwise pp = N (e.g. 8 gpus -> pp=4 x dp=2, 4 cpus -> pp=2 x dp=2)
#   the rest goes to `python -m pipeengine.train` (see `python -m pipeengine.train --help`)
#
# Environment (multi-node through torchrun's static rendezvous; defaults = one node):
#   NNODES=1 NODE_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500
#   LOG_RANK=0        which local rank's output to show (torchrun --local-ranks-filter); "all" for every rank
#   PYTHON=python     interpreter to use
#   MAX_RESTARTS=0    restart the whole group this many times when a worker dies (same as --max-restarts N;
#                     with the trainer's --save-interval, a restarted group resumes from its newest checkpoint)
#   RDZV_TIMEOUT=120  multi-node: seconds a node waits for the others at start-up before it gives up
# Exit status: the trainer's (0 done, 2 bad input, 3 a failure it explained, 130/143 stopped by Ctrl-C/SIGTERM);
# torchrun's own failure summary is shown only for crashes the trainer did not explain.
# Example, two nodes of 8 GPUs (run on each node with its NODE_RANK):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/pipe.sh 8 gpus --pp 8 --model gpt --preset small
# Slurm: see launch/slurm.sbatch.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }

if [[ $# -lt 2 || "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    usage
    [[ $# -ge 1 && ( "$1" == "-h" || "$1" == "--help" ) ]] && exit 0 || exit 2
fi
NPROC=$1; KIND=$2; shift 2
if ! [[ "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
    echo "pipe.sh: N must be a positive integer (got '$NPROC'); usage: launch/pipe.sh N gpus|cpus [flags]" >&2; exit 2
fi
case "$KIND" in
    gpus|gpu) DEVICE=cuda; BACKEND=nccl ;;
    cpus|cpu) DEVICE=cpu; BACKEND=gloo ;;
    *) echo "pipe.sh: second argument must be 'gpus' or 'cpus' (got '$KIND')" >&2; exit 2 ;;
esac

if [[ "$DEVICE" == cuda ]]; then   # count the GPUs before starting anything: nvidia-smi, else torch itself
    if command -v nvidia-smi >/dev/null 2>&1; then
        NGPU=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
    else
        NGPU=$("${PYTHON:-python}" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
    fi
    if (( NGPU == 0 )); then
        echo "pipe.sh: asked for $NPROC gpus but no CUDA GPU is visible on this node; use 'launch/pipe.sh $NPROC cpus'" >&2
        exit 2
    elif (( NGPU < NPROC )); then
        echo "pipe.sh: asked for $NPROC gpus but this node has $NGPU; use 'launch/pipe.sh $NGPU gpus' or 'cpus'" >&2
        exit 2
    fi
fi

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
LOG_RANK=${LOG_RANK:-0}
PYTHON=${PYTHON:-python}
WORLD=$((NPROC * NNODES))

# --max-restarts is torchrun's; --pp from the trainer flags, or the default split
MAX_RESTARTS=${MAX_RESTARTS:-0}
PP=""
ARGS=()
while (( $# )); do
    case "$1" in
        --max-restarts) MAX_RESTARTS=${2:-}; shift 2 || { echo "pipe.sh: --max-restarts needs a number" >&2; exit 2; }; continue ;;
        --max-restarts=*) MAX_RESTARTS=${1#--max-restarts=}; shift; continue ;;
        --pp) PP=${2:-} ;;
        --pp=*) PP=${1#--pp=} ;;
    esac
    ARGS+=("$1"); shift
done
if ! [[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]]; then
    echo "pipe.sh: --max-restarts must be a whole number >= 0 (got '$MAX_RESTARTS')" >&2; exit 2
fi
if [[ -z "$PP" ]]; then
    if (( WORLD >= 4 && WORLD % 2 == 0 )); then PP=$((WORLD / 2)); (( PP > 8 )) && PP=8; else PP=$WORLD; fi
    while (( WORLD % PP != 0 )); do PP=$((PP - 1)); done
    ARGS+=(--pp "$PP")
fi
if ! [[ "$PP" =~ ^[1-9][0-9]*$ ]] || (( WORLD % PP != 0 )); then
    echo "pipe.sh: --pp $PP does not divide the world size $WORLD (= $NPROC x $NNODES nodes)" >&2; exit 2
fi
echo "pipe.sh: $WORLD ranks = pp $PP x dp $((WORLD / PP)) on $NNODES node(s), $BACKEND on $DEVICE"

if [[ "$DEVICE" == cpu ]]; then
    CORES=$(nproc 2>/dev/null || echo 1)
    export OMP_NUM_THREADS=$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))
fi

FILTER=()
[[ "$LOG_RANK" != all ]] && FILTER=(--local-ranks-filter "$LOG_RANK" --tee 3)
if (( NNODES > 1 )); then
    if (( NODE_RANK == 0 )) && (exec 3<>"/dev/tcp/$MASTER_ADDR/$MASTER_PORT") 2>/dev/null; then
        echo "pipe.sh: port $MASTER_PORT on $MASTER_ADDR is already in use; set MASTER_PORT to a free port" \
             "(the same on every node)" >&2; exit 2
    fi
    RDZV=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
          --rdzv-conf "timeout=${RDZV_TIMEOUT:-120}")
else
    RDZV=(--standalone)
fi

CMD=("$PYTHON" -m torch.distributed.run "${RDZV[@]}" --nproc_per_node "$NPROC" --max-restarts "$MAX_RESTARTS"
     "${FILTER[@]}" -m pipeengine.train --device "$DEVICE" --backend "$BACKEND" "${ARGS[@]}")
echo "+ ${CMD[*]}" >&2
# torchrun's stderr goes through quiet.awk, which holds back torchrun's failure summary when every
# failed worker explained itself (exit 2, 3, 130 or 143) and exits with that status (else 0).
# The filter ignores Ctrl-C and SIGTERM: torchrun gets them and stops the workers.
set +e
{ "${CMD[@]}" 2>&1 1>&3 3>&- | (trap '' INT TERM; exec awk -f "$(dirname "$0")/quiet.awk") 1>&2; } 3>&1
STATUS=("${PIPESTATUS[@]}")
(( STATUS[1] != 0 )) && exit "${STATUS[1]}"
exit "${STATUS[0]}"
