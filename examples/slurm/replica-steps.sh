# A job of replicas in one SLURM allocation: the Lighthouse (torchft's quorum server) as a
# job step of its own on the first node, and one job step per replica on nodes of its own,
# each step relaunched alone when it fails. Sourced by examples/slurm/train-replicas.sbatch
# after it set up the job's environment; it sets SHARED first and may set NODES_PER_REPLICA,
# REPLICAS, MAX_REPLICA_FAILURES and the settings below. `run_replicas COMMAND ARGS...` runs
# COMMAND as every task of every replica until the run is trained, and exits the script.
#
# Why a step per replica: each replica is a JAX job of its own (its own jax.distributed
# coordinator on its step's first node, its own processes), joined to the others once a step
# by torchft's gradient exchange. A dead or hung process takes only its own step down (srun
# --kill-on-bad-exit ends the step's other tasks at once, so a half-dead replica never holds
# the others); only that step is launched again, on the same nodes, with the same variables.
# The other replicas' steps are never touched: they train on with a smaller quorum, the whole
# global batch split among them. The relaunched replica needs no checkpoint: it compiles,
# joins, and heals the state at the quorum's newest step from a live peer.

# ---- settings ------------------------------------------------------------------------
# Each replica: NODES_PER_REPLICA consecutive nodes of the allocation x --ntasks-per-node
# tasks (processes). REPLICAS (default: as many as the allocation's nodes hold) must be at
# least 2; nodes beyond REPLICAS x NODES_PER_REPLICA stay idle.
NODES_PER_REPLICA=${NODES_PER_REPLICA:-1}
# A replica whose step fails more than this many times gives up; the others train on as long
# as a majority of the job's replicas is left (a quorum needs a majority: two quorums can
# then never both advance from the same step, torchft's "split brain").
MAX_REPLICA_FAILURES=${MAX_REPLICA_FAILURES:-8}
# The Lighthouse dies: it is started again on the same node and port (the replicas keep
# their state and retry the quorum the restart broke), at most this many times.
LIGHTHOUSE_RESTARTS=${LIGHTHOUSE_RESTARTS:-20}
LIGHTHOUSE_WAIT_S=${LIGHTHOUSE_WAIT_S:-120}  # for it to listen before the replicas start
# Ports, each replica's its own (replica r: the base + r), so that replicas sharing a host (a
# test allocation on one machine) never meet: the Lighthouse's, each replica's jax.distributed
# coordinator's, each replica's store (the TCP store its processes' torchft Managers meet at,
# served by its process 0).
LIGHTHOUSE_PORT=${LIGHTHOUSE_PORT:-29510}
COORDINATOR_PORT=${COORDINATOR_PORT:-29600}
STORE_PORT=${STORE_PORT:-29800}
POLL_S=${POLL_S:-1}  # how often the script looks at the replicas' outcomes

refuse() { echo "$*"; exit 2; }
for name in NODES_PER_REPLICA MAX_REPLICA_FAILURES LIGHTHOUSE_RESTARTS LIGHTHOUSE_WAIT_S \
        LIGHTHOUSE_PORT COORDINATOR_PORT STORE_PORT; do
    [[ ${!name} =~ ^[0-9]+$ ]] || refuse "$name=${!name}: must be a whole number"
done
[[ $POLL_S =~ ^[0-9]+([.][0-9]+)?$ ]] || refuse "POLL_S=$POLL_S: must be seconds"
mapfile -t ALL_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
TASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-1}
(( NODES_PER_REPLICA >= 1 )) || refuse "NODES_PER_REPLICA=0: a replica needs a node"
REPLICAS=${REPLICAS:-$(( ${#ALL_NODES[@]} / NODES_PER_REPLICA ))}
if [[ ! $REPLICAS =~ ^[0-9]+$ ]] || (( REPLICAS < 2 )) ||
        (( REPLICAS * NODES_PER_REPLICA > ${#ALL_NODES[@]} )); then
    refuse "REPLICAS=$REPLICAS x NODES_PER_REPLICA=$NODES_PER_REPLICA: a job of replicas" \
        "needs at least 2 replicas, within the ${#ALL_NODES[@]} node(s) allocated (one" \
        "replica alone is train.sbatch)"
fi
MAJORITY=$(( REPLICAS / 2 + 1 ))
# sbatch runs this script on the allocation's first node: the Lighthouse runs beside it
LIGHTHOUSE_NODE=${ALL_NODES[0]}
LOGS=$SHARED/logs  # one log a replica (all its launches) and one for the Lighthouse
STATE=$SHARED/replica-steps/$SLURM_JOB_ID  # each loop's outcome: a file holding its exit
# Each task: its process id within its replica (the step's task number) and its stable
# name in its replica's health record; the rest of its job is the step's environment
TASK='export RESIHP_PROCESS_ID=$SLURM_PROCID RESIHP_HOST_ID=$SLURMD_NODENAME:$SLURM_LOCALID
exec "$@"'

# ---- one loop per step ---------------------------------------------------------------
STEP_PID=  # the running srun of this loop (each loop is a subshell of its own)
stop_step() { [[ -n $STEP_PID ]] && kill -TERM "$STEP_PID" 2>/dev/null && wait "$STEP_PID"; }
run_step() {  # srun ARGS...: in the background, so that a stop (SIGTERM) ends it at once
    srun "$@" &
    STEP_PID=$!
    wait "$STEP_PID"
}

lighthouse_loop() {
    local restarts=0 rc
    while :; do
        run_step --overlap --nodes=1 --ntasks=1 --nodelist="$LIGHTHOUSE_NODE" --export=ALL \
            --output="$LOGS/lighthouse.log" --open-mode=append "${LIGHTHOUSE[@]}"
        rc=$?
        if (( ++restarts > LIGHTHOUSE_RESTARTS )); then
            echo "the Lighthouse ended (exit $rc), and its" \
                "LIGHTHOUSE_RESTARTS=$LIGHTHOUSE_RESTARTS restarts are spent"
            return 1
        fi
        echo "the Lighthouse ended (exit $rc): restarting it on" \
            "$LIGHTHOUSE_NODE:$LIGHTHOUSE_PORT (restart $restarts of $LIGHTHOUSE_RESTARTS);" \
            "the replicas keep their state and form a new quorum"
        sleep 1
    done
}

replica_nodes() {  # replica r's nodes, comma-separated: NODES_PER_REPLICA consecutive ones
    local IFS=,
    echo "${ALL_NODES[*]:$(( $1 * NODES_PER_REPLICA )):NODES_PER_REPLICA}"
}

replica_loop() {  # r COMMAND ARGS...: replica r's step until it trains the run or gives up
    local r=$1 nodes failures=0 rc relaunch=""
    shift
    nodes=$(replica_nodes "$r")
    # the four variables that make the step's processes replica r of the job (rh.fit and
    # resihp train read them: resihp_jax/runtime/replicas/launched.py), and its own JAX job:
    # a coordinator on the step's first node (where its process 0 runs), on a port of its own
    export RESIHP_REPLICA=$r RESIHP_REPLICAS=$REPLICAS
    export RESIHP_LIGHTHOUSE=http://$LIGHTHOUSE_NODE:$LIGHTHOUSE_PORT
    export RESIHP_REPLICA_STORE=${nodes%%,*}:$(( STORE_PORT + r ))
    export RESIHP_COORDINATOR=${nodes%%,*}:$(( COORDINATOR_PORT + r ))
    export RESIHP_NUM_PROCESSES=$(( NODES_PER_REPLICA * TASKS_PER_NODE ))
    # its own directory (checkpoints, health record): rh.fit reads it; a `{replica}` in the
    # command's arguments (resihp train --checkpoint-dir DIR/replica{replica}) becomes r
    export RESIHP_CHECKPOINT_DIR=$SHARED/ckpt/replica$r
    mkdir -p "$RESIHP_CHECKPOINT_DIR"
    set -- "${@//\{replica\}/$r}"
    while :; do
        echo "replica $r: launched$relaunch on $nodes ($RESIHP_NUM_PROCESSES processes," \
            "coordinator $RESIHP_COORDINATOR)"
        run_step --overlap --nodes="$NODES_PER_REPLICA" --ntasks="$RESIHP_NUM_PROCESSES" \
            --ntasks-per-node="$TASKS_PER_NODE" --nodelist="$nodes" --kill-on-bad-exit=1 \
            --export=ALL ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} \
            --output="$LOGS/replica$r.log" --open-mode=append bash -c "$TASK" task "$@"
        rc=$?
        if (( rc == 0 )); then
            return 0
        elif (( rc == 2 )); then  # a bad flag or path: a relaunch cannot fix it
            return 2
        elif (( ++failures > MAX_REPLICA_FAILURES )); then
            echo "replica $r: its step failed (exit $rc) $failures times, more than" \
                "MAX_REPLICA_FAILURES=$MAX_REPLICA_FAILURES: it gives up"
            return "$rc"
        fi
        echo "replica $r: its step failed (exit $rc; 75: a step failed or passed its" \
            "deadline, 137: a process was killed): relaunching it alone (failure $failures" \
            "of $MAX_REPLICA_FAILURES); the other replicas train on and it heals from one" \
            "of them when it joins"
        relaunch=" again ($failures)"
    done
}

declare -A LOOPS=()  # name -> the loop's subshell
start_loop() {  # NAME FUNCTION ARGS...: in a subshell of its own; its exit in $STATE/NAME
    local name=$1
    shift
    (
        trap 'stop_step; exit 143' TERM
        "$@"
        # whole or not at all: the script reads it while the loop may still be writing
        echo "$?" > "$STATE/.$name" && mv "$STATE/.$name" "$STATE/$name"
    ) &
    LOOPS[$name]=$!
}
stop_loops() {  # every loop's step ended (srun ends its tasks), then the loops
    local pid
    for pid in "${LOOPS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    for pid in "${LOOPS[@]}"; do wait "$pid" 2>/dev/null; done
}

lighthouse_listening() {
    timeout 2 bash -c "exec 3<>/dev/tcp/$LIGHTHOUSE_NODE/$LIGHTHOUSE_PORT" 2>/dev/null
}

finished() {  # the job's end, once one is reached: exits the script
    local r code left=0
    for (( r = 0; r < REPLICAS; r++ )); do
        [[ -f $STATE/replica$r ]] || { left=$(( left + 1 )); continue; }
        code=$(< "$STATE/replica$r")
        if (( code == 0 )); then
            # the others are at that step too, or behind it, and cannot finish alone
            echo "replica $r trained the whole run: training finished; ending the other" \
                "replicas' steps and the Lighthouse"
            stop_loops
            exit 0
        elif (( code == 2 )); then  # every replica runs the same command
            echo "replica $r refused its input (exit 2): not relaunched; ending the job"
            stop_loops
            exit 2
        fi
    done
    if [[ -f $STATE/lighthouse ]]; then
        echo "the Lighthouse could not be kept up: no quorum can form; ending the job"
        stop_loops
        exit 1
    fi
    if (( left < MAJORITY )); then
        echo "$left of $REPLICAS replicas left, fewer than a majority ($MAJORITY): no quorum" \
            "can form; ending the job"
        stop_loops
        exit 1
    fi
}

run_replicas() {  # the command every task of every replica runs, with its arguments
    mkdir -p "$LOGS" "$STATE"
    rm -f "$STATE"/*
    # the Lighthouse's command line from the library itself: a quorum of a majority of the
    # replicas, the join and heartbeat timeouts of the replicas' own timeout ladder
    local made
    made=$(python - "$REPLICAS" "$LIGHTHOUSE_PORT" <<'EOF'
import sys
from resihp_jax.errors import ConfigError
from resihp_jax.runtime.replicas.lighthouse import lighthouse_command
from resihp_jax.runtime.replicas.torchft_engine import Timeouts
try:
    print("\n".join(lighthouse_command(int(sys.argv[1]), int(sys.argv[2]), Timeouts())))
except ConfigError as err:
    sys.exit(f"train-replicas: {err}")
EOF
) || exit 2
    mapfile -t LIGHTHOUSE <<< "$made"
    echo "job $SLURM_JOB_ID: $REPLICAS replicas x $NODES_PER_REPLICA node(s) x" \
        "$TASKS_PER_NODE task(s), a quorum of at least $MAJORITY; the Lighthouse on" \
        "$LIGHTHOUSE_NODE:$LIGHTHOUSE_PORT; logs in $LOGS"
    # SIGTERM (scancel, the end of the time limit): every step ended, nothing relaunched
    trap 'echo "SIGTERM: ending every step"; stop_loops; exit 143' TERM
    start_loop lighthouse lighthouse_loop
    local deadline=$(( SECONDS + LIGHTHOUSE_WAIT_S ))
    until lighthouse_listening; do
        if [[ -f $STATE/lighthouse ]] || (( SECONDS > deadline )); then
            echo "the Lighthouse is not listening on $LIGHTHOUSE_NODE:$LIGHTHOUSE_PORT" \
                "(see $LOGS/lighthouse.log): no replica started"
            stop_loops
            exit 1
        fi
        sleep 0.2
    done
    local r
    for (( r = 0; r < REPLICAS; r++ )); do
        start_loop "replica$r" replica_loop "$r" "$@"
    done
    while :; do
        sleep "$POLL_S" &
        wait $!  # (a wait, not sleep itself, lets the TERM trap run at once)
        finished
    done
}
