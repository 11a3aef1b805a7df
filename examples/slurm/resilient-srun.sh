# The relaunch loop of examples/slurm/train.sbatch and train-cpu.sbatch, sourced by both
# after they set up the job's environment. They set SHARED, MAX_FAILURES, PREEMPTED and
# FAILURES_FILE first, and may set TIME_LIMIT_GRACE_S and TRAIN_NODES (defaults below),
# SRUN_OPTIONS (an array of more srun options) and a function describe_run (what the
# incarnation line adds about the tasks); then `run_resilient COMMAND ARGS...` runs COMMAND
# as every task of the job until it finishes, relaunching and requeueing as described here,
# and exits the script.

TIME_LIMIT_GRACE_S=${TIME_LIMIT_GRACE_S:-90}
[[ $(declare -p SRUN_OPTIONS 2>/dev/null) == "declare -a"* ]] || SRUN_OPTIONS=()
preempted=0
# SIGTERM to this script too (scancel --full, the end of a preemption's grace time): srun,
# signalled as well, ends the tasks at once, before they write their copies
trap 'echo "SIGTERM: preempted"; preempted=1' TERM
# Near the time limit Slurm signals this script (--signal above): the tasks stop as in a
# preemption (SIGTERM to them only: each writes its copy of the last step and exits 74), then
# the job is requeued, uncounted, and resumes from those copies, so no step is trained twice.
# Should the tasks not be done within TIME_LIMIT_GRACE_S (under the --signal lead), the job is
# requeued anyway, before the limit ends it unrequeued.
if [[ ! $TIME_LIMIT_GRACE_S =~ ^[0-9]+([.][0-9]+)?$ ]]; then
    echo "TIME_LIMIT_GRACE_S=$TIME_LIMIT_GRACE_S: must be seconds >= 0 (less than the" \
        "--signal lead)"
    exit 2
fi
timelimit=0
grace_pid=
on_time_limit() {
    echo "time limit near: the tasks write their copies, then requeue"
    timelimit=1
    scancel --signal=TERM "$SLURM_JOB_ID"
    # `&&`: a sleep ended early (the tasks did end) stops the fallback before it requeues
    (sleep "$TIME_LIMIT_GRACE_S" && echo "the tasks did not end in time: requeue now" &&
     scontrol requeue "$SLURM_JOB_ID") &
    grace_pid=$!
}
trap on_time_limit USR1

# A failure that blames no node (a crash of every task, a step past its deadline) is
# relaunched at once on the same nodes (IN_PLACE_RELAUNCH=1, the default; 0: requeue
# instead). Should that relaunch fail too, the nodes may be what fails (a broken GPU): the
# job is requeued, and that second failure is not counted again.
IN_PLACE_RELAUNCH=${IN_PLACE_RELAUNCH:-1}
if [[ ! $IN_PLACE_RELAUNCH =~ ^[01]$ ]]; then
    echo "IN_PLACE_RELAUNCH=$IN_PLACE_RELAUNCH: must be 1 (relaunch once in the allocation) or 0"
    exit 2
fi
# Nodes: the first TRAIN_NODES nodes of the allocation train; any others wait as spares. A
# task that fails on its own (killed, crashed, its node lost, or left out as slow: 76) marks
# its node bad for the rest of the allocation, and the next run starts at once in the same
# allocation, on a spare in its place, or, with no spare left, on the nodes that are left
# (the job re-plans for fewer devices, and is requeued, uncounted, should it not fit them):
# no requeue, so no wait for SLURM (AuthInfo=cred_expire, 120 s by default) and no return
# to the queue. --no-kill keeps the allocation when a node is lost. When every node's tasks
# failed alike (a bug, a crash of the job as a whole), no node is blamed: the same nodes run
# again.
mapfile -t ALL_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
TRAIN_NODES=${TRAIN_NODES:-${#ALL_NODES[@]}}  # the calling script may set its own default
TASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-1}
if [[ ! $TRAIN_NODES =~ ^[1-9][0-9]*$ ]] || (( TRAIN_NODES > ${#ALL_NODES[@]} )); then
    echo "TRAIN_NODES=$TRAIN_NODES: must be a number of nodes from 1 to the" \
        "${#ALL_NODES[@]} allocated"
    exit 2
fi
bad_nodes=()
run_nodes=()  # by position: task (rank) r runs on run_nodes[r / TASKS_PER_NODE]
pick_nodes() {  # every good node keeps its place, a spare takes a bad one's, or the rest
    # close up (the job then re-plans): $run_nodes, $nodes, $NTASKS, $SLURM_HOSTFILE
    local node i spares=() picked=()
    (( ${#run_nodes[@]} > 0 )) || run_nodes=("${ALL_NODES[@]:0:TRAIN_NODES}")
    for node in "${ALL_NODES[@]}"; do
        [[ " ${bad_nodes[*]} ${run_nodes[*]} " == *" $node "* ]] || spares+=("$node")
    done
    for node in "${run_nodes[@]}"; do
        if [[ " ${bad_nodes[*]} " != *" $node "* ]]; then
            picked+=("$node")
        elif (( ${#spares[@]} > 0 )); then
            picked+=("${spares[0]}")
            spares=("${spares[@]:1}")
        fi
    done
    (( ${#picked[@]} > 0 )) || return 1
    run_nodes=("${picked[@]}")
    nodes=$(IFS=,; echo "${run_nodes[*]}")
    NTASKS=$(( ${#run_nodes[@]} * TASKS_PER_NODE ))
    # srun --distribution=arbitrary places task r on line r of this file (which also names
    # the step's nodes: srun refuses a --nodelist beside it): each rank stays on
    # its node across relaunches (a spare takes the failed node's ranks), so the survivors'
    # copies on each node's /dev/shm restore in place (--local-copy-dir)
    export SLURM_HOSTFILE="$SHARED/exits/$SLURM_JOB_ID.hosts"
    mkdir -p "$SHARED/exits"
    for node in "${run_nodes[@]}"; do
        for (( i = 0; i < TASKS_PER_NODE; i++ )); do echo "$node"; done
    done > "$SLURM_HOSTFILE"
}
# 75 is a task that lost a peer (its step failed or passed its deadline), also when the peer
# was process 0 and took the job's coordination service with it: the task says so in one
# line and is not the one to blame (before, JAX aborted it: 134, and every node was blamed)
blamed_nodes() {  # the nodes of the last run's tasks that failed on their own, or none
    local task node blamed=()
    for (( task = 0; task < NTASKS; task++ )); do
        case ${codes[task]} in 0 | "$PREEMPTED" | 75 | 77 | 143) continue ;; esac
        node=${run_nodes[task / TASKS_PER_NODE]}  # the hostfile's placement
        [[ " ${blamed[*]} " == *" $node "* ]] || blamed+=("$node")
    done
    (( ${#blamed[@]} < ${#run_nodes[@]} )) && echo "${blamed[*]}"
}
# A node that is lost while its tasks run holds srun until SLURM declares it down
# (SlurmdTimeout, 300 s by default): once every other task has ended and the nodes of those
# left stop answering (sinfo marks them `*`), srun is stopped, their tasks count as lost
# (their node is blamed), and the next run starts beside the dead step (srun --overlap).
POLL_S=2
given_up() {
    local task node reported=0 pending=()
    for (( task = 0; task < NTASKS; task++ )); do
        if [[ -f $EXITS/$task ]]; then reported=1; else pending+=("$task"); fi
    done
    (( reported && ${#pending[@]} > 0 )) || return 1
    for task in "${pending[@]}"; do
        node=${run_nodes[task / TASKS_PER_NODE]}
        [[ $(sinfo -h -N -n "$node" -o %t 2>/dev/null | head -1) == *"*" ]] || return 1
    done
}
in_place=0  # the last run was an in-place relaunch
# Each task: named after its node (the host id of the health record and of the survivors'
# copies: NODE:LOCAL_RANK), its own exit code recorded
TASK='trap : TERM; export RESIHP_HOST_ID=$SLURMD_NODENAME:$SLURM_LOCALID
"$@"; code=$?; echo "$code" > "$EXITS/$SLURM_PROCID"; exit "$code"'
every() {  # every task of the last run exited with one of the codes given
    local code
    for code in "${codes[@]}"; do [[ " $* " == *" $code "* ]] || return 1; done
}
run_resilient() {  # the command each task runs, with its arguments
    pick_nodes
    for (( run = 0; ; run++ )); do
        run_text=""
        (( run > 0 )) && run_text=", relaunch $run in the allocation,"
        echo "incarnation ${SLURM_RESTART_COUNT:-0}${run_text} of job $SLURM_JOB_ID on $nodes$(
            declare -F describe_run >/dev/null && describe_run "$@")"
        # Each task's own exit code lands in $EXITS/<task>: srun reports only the highest, and
        # after a failure it ends the other tasks with SIGTERM, so they exit 74 as if preempted.
        export EXITS="$SHARED/exits/$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}.$run"
        rm -rf "$EXITS" && mkdir -p "$EXITS"
        # No --devices and no job flags: JAX reads the job (coordinator, process count, this
        # process's id) from SLURM's variables. --export=ALL: the tasks get the script's
        # environment even when the job was submitted with --export=NONE (srun would
        # inherit that).
        srun --overlap --ntasks="$NTASKS" --distribution=arbitrary --kill-on-bad-exit=1 \
            --export=ALL --cpus-per-task="$SLURM_CPUS_PER_TASK" "${SRUN_OPTIONS[@]}" \
            bash -c "$TASK" \
            task "$@" &
        srun_pid=$!
        (  # srun would wait for a lost node's tasks until SLURM declares the node down
            while sleep "$POLL_S" && kill -0 "$srun_pid" 2>/dev/null; do
                if given_up; then
                    echo "node(s) not answering hold task(s) that never ended: srun stopped"
                    kill -9 "$srun_pid" 2>/dev/null
                    break
                fi
            done
        ) &
        watcher_pid=$!
        while :; do  # in the background, so the traps run at once; a trap ends a wait early
            wait "$srun_pid"
            rc=$?
            kill -0 "$srun_pid" 2>/dev/null || break
        done
        pkill -P "$watcher_pid" 2>/dev/null  # its sleep: the watcher then ends by itself
        if [[ -n $grace_pid ]]; then  # the tasks ended in time: no fallback requeue
            pkill -P "$grace_pid" 2>/dev/null  # its sleep first, so the fallback sees it fail
            kill "$grace_pid" 2>/dev/null
        fi

        codes=()
        for (( task = 0; task < NTASKS; task++ )); do
            codes+=("$(cat "$EXITS/$task" 2>/dev/null || echo lost)")
        done
        echo "srun exited with $rc; the tasks with: ${codes[*]}"
        if (( rc == 0 )); then
            echo "training finished"
            rm -rf "$SHARED/exits"
            exit 0
        fi
        # a bad flag or path, another run's checkpoints, no GPU where one is expected: a
        # restart cannot fix it
        refused=0
        (( rc == 2 )) || [[ " ${codes[*]} " == *" 2 "* ]] && refused=1
        if (( refused && ${#run_nodes[@]} < TRAIN_NODES )); then
            echo "the job does not fit the ${#run_nodes[@]} nodes left (exit 2): requeue for" \
                "TRAIN_NODES=$TRAIN_NODES, not counted again"
            scontrol requeue "$SLURM_JOB_ID"
            exit 0
        fi
        if (( refused )); then
            echo "a task refused its input (exit 2): not requeued"
            exit 2
        fi
        if (( timelimit )); then
            echo "time limit: requeue, not counted against MAX_FAILURES"
            scontrol requeue "$SLURM_JOB_ID"
            exit 0
        fi
        # 143: a task that SIGTERM ended before it could write a copy (still starting up)
        if (( preempted )) || every 0 "$PREEMPTED" 143; then
            echo "preempted (SIGTERM): requeue, not counted against MAX_FAILURES"
            scontrol requeue "$SLURM_JOB_ID"
            exit 0
        fi
        blamed=$(blamed_nodes)
        if [[ -z $blamed ]] && (( in_place )); then
            echo "srun failed again in this allocation (exit $rc): requeue, not counted again"
            scontrol requeue "$SLURM_JOB_ID"
            exit 0
        fi
        failures=$(( $(cat "$FAILURES_FILE" 2>/dev/null || echo 0) + 1 ))
        echo "$failures" > "$FAILURES_FILE"
        if (( failures > MAX_FAILURES )); then
            echo "srun failed with exit $rc; $failures failures exceed MAX_FAILURES=$MAX_FAILURES"
            exit "$rc"
        fi
        echo "srun failed with exit $rc (75: a step failed or passed its deadline; 76/77:" \
            "re-planned without a slow host; 137: a task was killed): failure $failures of" \
            "$MAX_FAILURES"
        if [[ -n $blamed ]]; then
            bad_nodes+=($blamed)
            if pick_nodes; then
                how="on a spare"
                (( ${#run_nodes[@]} < TRAIN_NODES )) && how="no spare left: ${#run_nodes[@]} of"
                (( ${#run_nodes[@]} < TRAIN_NODES )) && how+=" TRAIN_NODES=$TRAIN_NODES, re-planned"
                echo "relaunch inside the allocation without node(s) $blamed ($how): on $nodes"
                in_place=0
                continue
            fi
        fi
        # a host left out (76/77) with no spare for it: the same nodes would bring it back
        if [[ " ${codes[*]} " == *" 76 "* || " ${codes[*]} " == *" 77 "* ]] ||
                (( ! IN_PLACE_RELAUNCH )); then
            echo "requeue"
            scontrol requeue "$SLURM_JOB_ID"
            exit 0
        fi
        echo "relaunch inside the allocation on the same nodes"
        in_place=1
    done
}
