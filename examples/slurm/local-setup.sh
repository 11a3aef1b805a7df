#!/bin/bash
# A real SLURM on this one machine (Debian/Ubuntu, as root), to try examples/slurm/*.sbatch
# and run tests/cli/test_slurm_real.py: installs slurm-wlm and munge if absent, writes a
# slurm.conf, starts munged, slurmctld and slurmd. Safe to run again: what is already there
# is kept and said so; daemons already running are left alone.
#
#   sudo examples/slurm/local-setup.sh            # then: sinfo; sbatch ...
#   CPUS=8 CRED_EXPIRE=10 examples/slurm/local-setup.sh
#   NODES=3 examples/slurm/local-setup.sh         # 3 nodes, for a job with a spare node
#
# NODES (default 1): how many SLURM nodes this machine plays. More than one: each is a slurmd
# of its own (NAME-n1, NAME-n2, ...: this host's name and a number, listed in /etc/hosts as
# 127.0.0.1 so JAX finds its coordinator by the node's name), so a job can lose one node and
# go on on another (examples/slurm/train-cpu.sbatch with TRAIN_NODES below the allocation).
# CPUS (default 8, at least 4): CPUs slurmd announces, i.e. how many tasks fit at once; it
# may exceed the machine's cores (config_overrides): the tasks then share them.
# CRED_EXPIRE (default 10 s; SLURM's own default is 120 s): how long SLURM holds a requeued
# job before it may start again (AuthInfo=cred_expire), so a local requeue is quick.
# A slurm.conf that this script did not write is never overwritten.
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
CPUS=${CPUS:-8}
CRED_EXPIRE=${CRED_EXPIRE:-10}
NODES=${NODES:-1}
MARK="# written by resihp_jax examples/slurm/local-setup.sh"
say() { echo "local-setup: $*"; }

if (( EUID != 0 )); then
    echo "local-setup: run as root (it installs packages and starts daemons)" >&2
    exit 1
fi
if [[ ! $NODES =~ ^[1-9][0-9]?$ ]]; then
    echo "local-setup: NODES=$NODES: must be a number of nodes from 1 to 99" >&2
    exit 1
fi
if (( CPUS < 4 )); then
    echo "local-setup: CPUS=$CPUS: the examples run 4 tasks; use CPUS >= 4" >&2
    exit 1
fi

# ---- packages ------------------------------------------------------------------------
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sbatch >/dev/null && command -v munged >/dev/null; then
    say "slurm-wlm and munge already installed ($(slurmd -V))"
else
    say "installing slurm-wlm and munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm munge
fi

# ---- munge ---------------------------------------------------------------------------
if [[ ! -s /etc/munge/munge.key ]]; then
    say "creating /etc/munge/munge.key"
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "munged already running"
else
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

# ---- slurm.conf ----------------------------------------------------------------------
HOST=$(hostname -s)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p "$CONF_DIR" /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm /run/slurm
NAMES=("$HOST")  # the nodes' names
if (( NODES > 1 )); then
    NAMES=()
    for (( i = 1; i <= NODES; i++ )); do NAMES+=("$HOST-n$i"); done
    # slurmd -N NAME: one daemon per node, each with its own port, spool, pid file and log
    NODE_LINES=""
    for (( i = 1; i <= NODES; i++ )); do
        NODE_LINES+="NodeName=$HOST-n$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((17100 + i))"
        NODE_LINES+=" CPUs=$CPUS RealMemory=$(( MEM_MB / NODES )) State=UNKNOWN"$'\n'
        mkdir -p "/var/lib/slurm/slurmd/$HOST-n$i"
    done
    SLURMD_FILES="SlurmdPidFile=/run/slurm/slurmd-%n.pid
SlurmdSpoolDir=/var/lib/slurm/slurmd/%n
SlurmdLogFile=/var/log/slurm/slurmd-%n.log"
    PARTITION_NODES="$HOST-n[1-$NODES]"
    HOSTS_LINE="127.0.0.1 ${NAMES[*]} $MARK"
    if ! grep -qxF "$HOSTS_LINE" /etc/hosts; then
        say "adding the nodes' names to /etc/hosts: ${NAMES[*]}"
        { grep -vF "$MARK" /etc/hosts; echo "$HOSTS_LINE"; } > /etc/hosts.resihp-new
        cat /etc/hosts.resihp-new > /etc/hosts && rm -f /etc/hosts.resihp-new
    fi
else
    NODE_LINES="NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN"$'\n'
    SLURMD_FILES="SlurmdPidFile=/run/slurm/slurmd.pid
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmdLogFile=/var/log/slurm/slurmd.log"
    PARTITION_NODES=$HOST
fi
if [[ -f $CONF ]] && ! grep -qF "$MARK" "$CONF"; then
    say "$CONF exists and was not written by this script: kept as it is"
else
    NEW=$(mktemp)
    cat > "$NEW" <<EOF
$MARK
# $NODES node(s), all this machine: $CPUS CPUs announced each, tasks share its cores.
ClusterName=resihp-local
SlurmctldHost=$HOST
# a machine of your own: the daemons run as root (a shared cluster uses a slurm user)
SlurmUser=root
AuthType=auth/munge
# a requeued job waits about cred_expire seconds before it may start again (default 120)
AuthInfo=cred_expire=$CRED_EXPIRE
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
$SLURMD_FILES
# no cgroups needed (containers, VMs without systemd)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
# more CPUs than cores may be announced
SlurmdParameters=config_overrides
MailProg=/bin/true
# look for startable jobs (a requeued one, once cred_expire has passed) every 5 s, not 30-60
SchedulerParameters=bf_interval=5,sched_interval=5
KillWait=30
${NODE_LINES}PartitionName=local Nodes=$PARTITION_NODES Default=YES MaxTime=INFINITE State=UP
EOF
    if [[ -f $CONF ]] && cmp -s "$NEW" "$CONF"; then
        say "$CONF already as wanted"
        rm -f "$NEW"
    else
        mv "$NEW" "$CONF" && chmod 644 "$CONF"
        say "wrote $CONF (${NAMES[*]}: $CPUS CPUs each, ${MEM_MB} MB in all," \
            "cred_expire=$CRED_EXPIRE s)"
        CHANGED=1
    fi
fi

# ---- daemons -------------------------------------------------------------------------
running() { pgrep -x "$1" >/dev/null; }
slurmd_running() {  # node name
    local pidfile=/run/slurm/slurmd.pid
    (( NODES > 1 )) && pidfile=/run/slurm/slurmd-$1.pid
    [[ -f $pidfile ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null
}
start() {  # daemon [its arguments]: started, or the end of its log
    say "starting $*"
    local log=/var/log/slurm/$1.log
    [[ $1 == slurmd ]] && (( NODES > 1 )) && log=/var/log/slurm/slurmd-$3.log
    if ! "/usr/sbin/$1" "${@:2}" || ! { sleep 1; running "$1"; }; then
        echo "local-setup: $* did not start; the end of $log:" >&2
        tail -n 20 "$log" >&2
        exit 1
    fi
}
if [[ -n ${CHANGED:-} ]] && { running slurmctld || running slurmd; }; then
    # nodes added or removed: slurmctld must restart (a reconfigure does not take them), and
    # every slurmd with it; jobs still running are lost
    say "slurm.conf changed: restarting slurmctld and slurmd"
    pkill -x slurmctld || true
    pkill -x slurmd || true
    for _ in $(seq 50); do running slurmctld || running slurmd || break; sleep 0.2; done
fi
if running slurmctld; then
    say "slurmctld already running"
else
    start slurmctld
fi
for name in "${NAMES[@]}"; do
    if slurmd_running "$name"; then
        say "slurmd of $name already running"
    elif (( NODES > 1 )); then
        start slurmd -N "$name"
    else
        start slurmd
    fi
done
for name in "${NAMES[@]}"; do
    for _ in $(seq 100); do
        state=$(sinfo -h -n "$name" -o %t 2>/dev/null | head -1 || true)
        [[ $state == idle* || $state == mix* || $state == alloc* ]] && break
        sleep 0.2
    done
    if [[ ${state:-} == down* || ${state:-} == drain* ]]; then
        scontrol update nodename="$name" state=resume || true
    fi
done
say "ready: $(sinfo -h -o '%P %D node(s) %t, %c CPUs' | head -1)"
