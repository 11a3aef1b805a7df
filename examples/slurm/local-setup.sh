#!/bin/bash
# A real SLURM on this one machine (Debian/Ubuntu, as root), to try examples/slurm/*.sbatch
# and run tests/cli/test_slurm_real.py: installs slurm-wlm and munge if absent, writes a
# single-node slurm.conf, starts munged, slurmctld and slurmd. Safe to run again: what is
# already there is kept and said so; daemons already running are left alone.
#
#   sudo examples/slurm/local-setup.sh            # then: sinfo; sbatch ...
#   CPUS=8 CRED_EXPIRE=10 examples/slurm/local-setup.sh
#
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
MARK="# written by resihp_jax examples/slurm/local-setup.sh"
say() { echo "local-setup: $*"; }

if (( EUID != 0 )); then
    echo "local-setup: run as root (it installs packages and starts daemons)" >&2
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
if [[ -f $CONF ]] && ! grep -qF "$MARK" "$CONF"; then
    say "$CONF exists and was not written by this script: kept as it is"
else
    NEW=$(mktemp)
    cat > "$NEW" <<EOF
$MARK
# One node, this machine: $CPUS CPUs announced, tasks share its cores.
ClusterName=resihp-local
SlurmctldHost=$HOST
# a machine of your own: the daemons run as root (a shared cluster uses a slurm user)
SlurmUser=root
AuthType=auth/munge
# a requeued job waits about cred_expire seconds before it may start again (default 120)
AuthInfo=cred_expire=$CRED_EXPIRE
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
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
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
    if [[ -f $CONF ]] && cmp -s "$NEW" "$CONF"; then
        say "$CONF already as wanted"
        rm -f "$NEW"
    else
        mv "$NEW" "$CONF" && chmod 644 "$CONF"
        say "wrote $CONF ($HOST: $CPUS CPUs, ${MEM_MB} MB, cred_expire=$CRED_EXPIRE s)"
        CHANGED=1
    fi
fi

# ---- daemons -------------------------------------------------------------------------
running() { pgrep -x "$1" >/dev/null; }
start() {  # daemon: started, or the end of its log
    say "starting $1"
    if ! "/usr/sbin/$1" || ! { sleep 1; running "$1"; }; then
        echo "local-setup: $1 did not start; the end of /var/log/slurm/$1.log:" >&2
        tail -n 20 "/var/log/slurm/$1.log" >&2
        exit 1
    fi
}
if running slurmctld && [[ -n ${CHANGED:-} ]]; then
    say "slurmctld already running: reconfiguring it for the new slurm.conf"
    scontrol reconfigure
elif running slurmctld; then
    say "slurmctld already running"
else
    start slurmctld
fi
if running slurmd; then
    say "slurmd already running"
else
    start slurmd
fi
for _ in $(seq 100); do
    state=$(sinfo -h -n "$HOST" -o %t 2>/dev/null | head -1 || true)
    [[ $state == idle* || $state == mix* || $state == alloc* ]] && break
    sleep 0.2
done
if [[ ${state:-} == down* || ${state:-} == drain* ]]; then
    scontrol update nodename="$HOST" state=resume || true
fi
say "ready: $(sinfo -h -o '%P %D node(s) %t, %c CPUs' | head -1)"
