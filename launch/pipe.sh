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
# Environment (defaults = one node):
#   NNODES=1 NODE_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500
#                     several nodes: torchrun's c10d rendezvous, hosted by node 0 (NODE_RANK=0) at
#                     MASTER_ADDR:MASTER_PORT; every node runs this script with the same NNODES and RDZV_ID.
#                     NNODES=MIN:MAX is elastic: a node gone for good (or one that joins) restarts the group
#                     at the new size, which the trainer re-plans (pp x dp, same global batch) from the newest
#                     checkpoint in --save-dir (a folder every node shares). Restarts need --max-restarts.
#   RDZV_ID=$SLURM_JOB_ID or "none"   names the rendezvous (the same on every node of one job)
#   LAST_CALL=5       seconds the rendezvous waits for more nodes once MIN are there
#   RDZV_CONF=        more torchrun --rdzv-conf settings, e.g. keep_alive_interval=5,heartbeat_timeout=30 (a lost
#                     node is noticed after a few missed keep-alives)
#   LOG_RANK=0        which local rank's output to show (torchrun --local-ranks-filter); "all" for every rank
#   RANK_LOGS=<log dir>/.ranks/<time>-<pid>   every rank's stdout/stderr files (torchrun --log-dir), linked from
#                     the run folder as ranks/
#   PYTHON=python     interpreter to use
#   MAX_RESTARTS=0    restart the whole group this many times when a worker dies (same as --max-restarts N;
#                     with the trainer's --save-interval, a restarted group resumes from its newest checkpoint)
#   RDZV_TIMEOUT=120  multi-node: seconds a node waits for the others at start-up before it gives up
# Exit status: the trainer's (0 done, 2 bad input, 3 a failure it explained, 129/130/143 stopped by
# SIGHUP/Ctrl-C/SIGTERM); torchrun's own failure summary is shown only for crashes the trainer did not explain.
# SIGTERM, SIGINT or SIGHUP to this script reach every worker through torchrun; SIGKILL ends torchrun too.
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
if ! [[ "$NNODES" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]]; then
    echo "pipe.sh: NNODES must be a number of nodes or a range MIN:MAX (got '$NNODES')" >&2; exit 2
fi
MIN_NODES=${NNODES%%:*}; MAX_NODES=${NNODES##*:}
if (( MIN_NODES > MAX_NODES )); then
    echo "pipe.sh: NNODES=$NNODES: MIN is larger than MAX" >&2; exit 2
fi
if (( MIN_NODES < MAX_NODES )) && [[ -z "${RDZV_ID:-${SLURM_JOB_ID:-}}" ]]; then
    echo "pipe.sh: NNODES=$NNODES (elastic) needs RDZV_ID, a name for this job that is the same on every node" \
         "(Slurm's job id is taken when there): a group that changes size finds this job's checkpoints by it" >&2
    exit 2
fi
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
LOG_RANK=${LOG_RANK:-0}
PYTHON=${PYTHON:-python}
WORLD=$((NPROC * MAX_NODES))

# --max-restarts is torchrun's; --pp from the trainer flags, or the default split
MAX_RESTARTS=${MAX_RESTARTS:-0}
PP=""
LOG_DIR=runs
ARGS=()
while (( $# )); do
    case "$1" in
        --max-restarts) MAX_RESTARTS=${2:-}; shift 2 || { echo "pipe.sh: --max-restarts needs a number" >&2; exit 2; }; continue ;;
        --max-restarts=*) MAX_RESTARTS=${1#--max-restarts=}; shift; continue ;;
        --pp) PP=${2:-} ;;
        --pp=*) PP=${1#--pp=} ;;
        --log-dir) LOG_DIR=${2:-runs} ;;
        --log-dir=*) LOG_DIR=${1#--log-dir=} ;;
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
    echo "pipe.sh: --pp $PP does not divide the world size $WORLD (= $NPROC x $MAX_NODES nodes)" >&2; exit 2
fi
if (( MIN_NODES < MAX_NODES )); then
    export PIPEENGINE_ELASTIC=1   # the trainer re-plans pp x dp when the group restarts at another size
    echo "pipe.sh: $WORLD ranks = pp $PP x dp $((WORLD / PP)) on $MAX_NODES nodes (elastic: down to $MIN_NODES," \
         "re-planned at each size), $BACKEND on $DEVICE"
else
    echo "pipe.sh: $WORLD ranks = pp $PP x dp $((WORLD / PP)) on $NNODES node(s), $BACKEND on $DEVICE"
fi

if [[ "$DEVICE" == cpu ]]; then
    CORES=$(nproc 2>/dev/null || echo 1)
    export OMP_NUM_THREADS=$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))
fi

# Every rank's output goes to its own files (torchrun --log-dir; the run folder links them as ranks/). On
# screen: rank LOG_RANK's. On a terminal that rank writes its progress straight to it (one line updated in
# place, without torchrun's prefix); its stderr still comes through torchrun.
RANK_LOGS=${RANK_LOGS:-$LOG_DIR/.ranks/$(date +%Y%m%d-%H%M%S)-$$}
mkdir -p "$RANK_LOGS"
export PIPEENGINE_RANK_LOGS
PIPEENGINE_RANK_LOGS=$(cd "$RANK_LOGS" && pwd)
FILTER=(--log-dir "$RANK_LOGS" --redirects 3 --tee 3)
if [[ "$LOG_RANK" != all ]]; then
    FILTER+=(--local-ranks-filter "$LOG_RANK")
    if [[ -t 1 && -e /proc/$$/fd/1 ]]; then
        export PIPEENGINE_CONSOLE PIPEENGINE_CONSOLE_RANK=$LOG_RANK
        PIPEENGINE_CONSOLE=$(readlink -f "/proc/$$/fd/1")
        FILTER=(--log-dir "$RANK_LOGS" --redirects 3 --tee 2 --local-ranks-filter "$LOG_RANK")
    fi
fi
if (( MAX_NODES > 1 )); then
    if (( NODE_RANK == 0 )) && (exec 3<>"/dev/tcp/$MASTER_ADDR/$MASTER_PORT") 2>/dev/null; then
        echo "pipe.sh: port $MASTER_PORT on $MASTER_ADDR is already in use; set MASTER_PORT to a free port" \
             "(the same on every node)" >&2; exit 2
    fi
    if (( NODE_RANK > 0 )); then   # node 0 hosts the rendezvous: wait for it here, and say so if it never comes
        SECONDS=0; ASKED=0   # asked every 0.2 s: the node joins as soon as node 0's rendezvous is up
        until (exec 3<>"/dev/tcp/$MASTER_ADDR/$MASTER_PORT") 2>/dev/null; do
            if (( SECONDS >= ${RDZV_TIMEOUT:-120} )); then
                echo "pipe.sh: node 0 ($MASTER_ADDR:$MASTER_PORT) did not answer within ${RDZV_TIMEOUT:-120} s;" \
                     "start node 0 first (NODE_RANK=0), or check MASTER_ADDR, MASTER_PORT and the firewall" >&2
                exit 2
            fi
            (( ASKED++ == 0 )) && echo "pipe.sh: waiting for node 0 at $MASTER_ADDR:$MASTER_PORT" \
                                       "(up to RDZV_TIMEOUT=${RDZV_TIMEOUT:-120} s)" >&2
            sleep 0.2
        done
    fi
    # c10d rendezvous: --max-restarts restarts the group on every node, and NNODES=MIN:MAX lets it shrink.
    # Node 0 hosts it (is_host), so two "nodes" on one machine work too. Each round gets a store of its own
    # (not the agent's shared one): a node's restart count is its own, the trainer's store keys cannot be.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    IS_HOST=$(( NODE_RANK == 0 ? 1 : 0 ))
    RDZV=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
          --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-none}}"
          --rdzv-conf "join_timeout=${RDZV_TIMEOUT:-120},is_host=$IS_HOST,last_call_timeout=${LAST_CALL:-5}${RDZV_CONF:+,$RDZV_CONF}")
else
    RDZV=(--standalone)
fi

CMD=("$PYTHON" -m torch.distributed.run "${RDZV[@]}" --nproc_per_node "$NPROC" --max-restarts "$MAX_RESTARTS"
     "${FILTER[@]}" -m pipeengine.train --device "$DEVICE" --backend "$BACKEND" "${ARGS[@]}")
echo "+ ${CMD[*]}" >&2
# torchrun runs in the background of this script, in a session of its own, so that the script passes it
# SIGTERM, SIGINT and SIGHUP exactly once (torchrun passes them to the workers, which stop after the same
# step and write their summary), and it dies with the script even on SIGKILL (PR_SET_PDEATHSIG; its
# workers follow their parent).
# Its stderr goes through quiet.awk, which holds back torchrun's failure summary when every failed
# worker explained itself (exit 2, 3, 129, 130 or 143) and exits with that status (else 0).
DIE_WITH_ME='import ctypes, os, signal, sys
os.setsid()   # signals reach torchrun once, forwarded by this script (a terminal signals its group)
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG (Linux)
except (AttributeError, OSError):
    pass
os.execvp(sys.argv[1], sys.argv[1:])'
# mawk (Debian's awk) reads a pipe in blocks: without -W interactive the ranks' stderr (a wait-for report) would
# reach the screen only when the job ends
AWK=(awk)
awk -W version 2>/dev/null | grep -q mawk && AWK=(awk -W interactive)
set +e
exec 4> >(trap '' INT TERM HUP; exec "${AWK[@]}" -v reports="$RANK_LOGS" -v nnodes="$NNODES" -v timeout="${RDZV_TIMEOUT:-120}" \
          -v endpoint="$MASTER_ADDR:$MASTER_PORT" -f "$(dirname "$0")/quiet.awk" 1>&2)
FILTER_PID=$!
"$PYTHON" -c "$DIE_WITH_ME" "${CMD[@]}" 2>&4 3>&- &
TORCHRUN=$!
for sig in INT TERM HUP; do trap "kill -s $sig $TORCHRUN 2>/dev/null" "$sig"; done
while true; do   # a trapped signal ends `wait` early: wait again until torchrun has exited
    wait "$TORCHRUN"; CODE=$?
    kill -0 "$TORCHRUN" 2>/dev/null || break
done
exec 4>&-
wait "$FILTER_PID"; EXPLAINED=$?
case "$EXPLAINED" in 0|2|3|129|130|143) ;;   # what quiet.awk exits with; anything else: it was killed
    *) echo "pipe.sh: the output filter (quiet.awk) ended with status $EXPLAINED (killed?): torchrun's output after" \
            "that was not shown; every rank's is in $RANK_LOGS; torchrun exited $CODE" >&2
       EXPLAINED=0 ;;
esac
if [[ "$LOG_RANK" != all ]] && (( CODE != 0 )); then   # a failure reported by a rank not on screen (rank 0 was stopped or dead)
    for f in "$RANK_LOGS"/shown-by-rank*.txt; do [[ -e "$f" ]] && cat "$f" >&2; done
fi
(( EXPLAINED != 0 )) && exit "$EXPLAINED"
exit "$CODE"
