#!/usr/bin/env bash
# A real, local Slurm cluster for the tests: one slurmctld and N slurmd from Debian's packages, no systemd.
#
#   tests/cluster/local_slurm.sh start [NODES]   # idempotent; default 6 nodes nid000001..nid00000N
#   tests/cluster/local_slurm.sh stop            # kills every daemon and job process by PID, removes the network
#   tests/cluster/local_slurm.sh status
#   eval "$(tests/cluster/local_slurm.sh env)"   # SLURM_CONF for sbatch/srun/squeue in this shell
#
# Every node is its own host: a network namespace (own IP on a bridge) and a UTS namespace (own hostname),
# named like Perlmutter's compute nodes. A rank that wrongly rendezvouses at "localhost" therefore fails
# here, as it would on a real cluster, instead of silently forming one world per node on a shared loopback.
# Nodes advertise Perlmutter's shape (feature "gpu", 4 GPUs as a count-only GRES, 128 CPUs), so the sbatch
# files in slurm/ run unchanged; a Shifter stand-in (shifter/: SPANK plugin, shifterimg, shifter) runs images as Perlmutter does.
#
# LOCAL_SLURM_SHAPE=host starts a second, separate cluster (own state, network, names and port; nodes
# cpu000001..) whose nodes declare this machine's own sockets and cores and bind each task to its cores
# (task/affinity), as Perlmutter's do: Perlmutter's 128 CPUs per node cannot be bound on a small machine,
# and the task plugin is one for the whole cluster. Its jobs name their CPUs (--cpus-per-task=1 here).
#
# All state (configs, logs, spool, munge key and socket, PID files) lives under $LOCAL_SLURM_DIR.
set -euo pipefail

SHAPE=${LOCAL_SLURM_SHAPE:-perlmutter}
case $SHAPE in
perlmutter) NAME=hpcml NODE_PREFIX=nid CTLD_PORT=6817 DEFAULT_SUBNET=10.250.0 ;;
host) NAME=hpcmlhost NODE_PREFIX=cpu CTLD_PORT=6827 DEFAULT_SUBNET=10.251.0 ;;
*) echo "local_slurm: error: LOCAL_SLURM_SHAPE must be perlmutter or host, got '$SHAPE'" >&2; exit 2 ;;
esac
STATE_DIR=${LOCAL_SLURM_DIR:-/tmp/$NAME-slurm}
SUBNET=${LOCAL_SLURM_SUBNET:-$DEFAULT_SUBNET}   # the test hosts' own addresses, on a bridge this script creates
# How long Slurm holds a requeued job before it starts it again: until the job's step credentials expire
# (AuthInfo's cred_expire; Slurm's default, 120 s, where a site sets none). 30 s still covers a step's
# launch here, and the default tier waits out one requeue; make test-scale measures Slurm's 120 s.
CRED_EXPIRE=${LOCAL_SLURM_CRED_EXPIRE:-30}
BRIDGE=${NAME}br0
CONTROLLER_NAME=$NAME-ctl
HOSTS_MARKER="# $NAME-local-slurm"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

log() { printf 'local_slurm: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

node_name() { printf '%s%06d' "$NODE_PREFIX" "$1"; }
node_ip() { printf '%s.%d' "$SUBNET" $((10 + $1)); }

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

ensure_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    command -v munged >/dev/null || missing+=(munge)
    [[ -f /usr/include/slurm/spank.h ]] || missing+=(libslurm-dev)
    command -v gcc >/dev/null || missing+=(gcc)
    command -v ip >/dev/null || missing+=(iproute2)
    command -v unshare >/dev/null || missing+=(util-linux)
    if ((${#missing[@]})); then
        [[ $(id -u) == 0 ]] || die "missing packages (${missing[*]}); install them as root"
        log "installing ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

# Perlmutter's GPU node (1 socket of 64 cores, 2 threads each), or this machine's own sockets and cores.
node_shape() {
    if [[ $SHAPE == perlmutter ]]; then
        echo "CPUs=128 Boards=1 SocketsPerBoard=1 CoresPerSocket=64 ThreadsPerCore=2"
        return
    fi
    local cpus sockets cores
    cpus=$(lscpu -p=CPU | grep -vc '^#')
    sockets=$(lscpu -p=SOCKET | grep -v '^#' | sort -u | wc -l)
    cores=$(lscpu -p=CORE,SOCKET | grep -v '^#' | sort -u | wc -l)
    echo "CPUs=$cpus Boards=1 SocketsPerBoard=$sockets CoresPerSocket=$((cores / sockets)) ThreadsPerCore=$((cpus / cores))"
}

# The Perlmutter-shaped nodes share this machine's few CPUs, which cannot hold 32 bound CPUs per task: no
# binding there (srun says "cluster configuration lacks support for cpu binding"). The host-shaped ones bind
# each task to its cores (task/affinity) and, where this machine's cgroup v1 cpuset hierarchy is writable,
# confine each job step to them (task/cgroup, ConstrainCores), as Perlmutter's nodes do.
cgroup_cpusets() {
    [[ $SHAPE == host && -w /sys/fs/cgroup/cpuset/cpuset.cpus && $(stat -fc %T /sys/fs/cgroup/cpuset) == cgroupfs ]]
}

# With task/cgroup, memory too where that hierarchy is writable: memory is then allocated as cores are
# (CR_Core_Memory; the node declares this machine's memory, less 1 GiB, and a job that names none gets its
# cores' share), a job's --mem is its limit, and a job over it is ended by the kernel's OOM killer (srun: "task N:
# Out Of Memory"), as where a site limits memory per job.
cgroup_memory() {
    cgroup_cpusets && [[ -w /sys/fs/cgroup/memory/cgroup.procs && $(stat -fc %T /sys/fs/cgroup/memory) == cgroupfs ]]
}

node_memory_mb() {
    if cgroup_memory; then
        echo $(($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 - 1024))
    else
        echo 4000
    fi
}

select_parameters() {
    if cgroup_memory; then
        echo "SelectTypeParameters=CR_Core_Memory"
        echo "DefMemPerCPU=$(($(node_memory_mb) / $(lscpu -p=CPU | grep -vc '^#')))"
    else
        echo "SelectTypeParameters=CR_Core"
    fi
}

task_plugin() {
    if [[ $SHAPE == perlmutter ]]; then
        echo "TaskPlugin=task/none"
    elif cgroup_cpusets; then
        echo "TaskPlugin=task/affinity,task/cgroup"
    else
        echo "TaskPlugin=task/affinity"
    fi
}

write_configs() {
    local nodes=$1 i name
    mkdir -p "$STATE_DIR"/{etc,log,run,ctld,spool,munge,munge-key,cgroup-empty}
    # Jobs are submitted by normal users too: they reach munged's socket; only root reads the key.
    chmod 755 "$STATE_DIR" "$STATE_DIR/munge"
    chmod 700 "$STATE_DIR/munge-key"
    local hostlist
    hostlist="${NODE_PREFIX}[$(printf '%06d' 1)-$(printf '%06d' "$nodes")]"

    {
        cat <<EOF
# Generated by tests/cluster/local_slurm.sh; rewritten on every start.
ClusterName=hpcml-local
SlurmctldHost=$CONTROLLER_NAME($SUBNET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE_DIR/munge/munge.socket.2,cred_expire=$CRED_EXPIRE
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/spool/%n
SlurmctldPidFile=$STATE_DIR/run/slurmctld.pid
SlurmdPidFile=$STATE_DIR/run/slurmd-%n.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log
SlurmctldPort=$CTLD_PORT
SlurmdPort=6818
PlugStackConfig=$STATE_DIR/etc/plugstack.conf
ProctrackType=proctrack/linuxproc
$(task_plugin)
# Nodes declare Perlmutter's shape, not this machine's (LOCAL_SLURM_SHAPE=host: this machine's).
SlurmdParameters=config_overrides
SelectType=select/cons_tres
$(select_parameters)
GresTypes=gpu
# pmi2 so MPICH ranks form one world; with "none" they silently run as N separate rank-0 jobs.
MpiDefault=pmi2
# Finished jobs leave the queue quickly, so "sbatch --wait" returns promptly.
MinJobAge=5
# Jobs that can never run are rejected at submission instead of pending forever.
EnforcePartLimits=ALL
ReturnToService=2
# sbatch --wait exits 0 for a job cancelled while pending: tests read the final state from here.
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE_DIR/jobcomp.txt
JobRequeue=1
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
SchedulerType=sched/backfill
MailProg=/bin/true
EOF
        for ((i = 1; i <= nodes; i++)); do
            name=$(node_name "$i")
            echo "NodeName=$name NodeAddr=$(node_ip "$i") NodeHostname=$name $(node_shape) RealMemory=$(node_memory_mb) Gres=gpu:4 Feature=gpu State=UNKNOWN"
        done
        echo "PartitionName=gpu Nodes=$hostlist Default=YES MaxTime=INFINITE State=UP"
    } >"$STATE_DIR/etc/slurm.conf"

    # Four GPUs per node, so --gpus-per-node is accepted and accounted. Slurm 22.05 drops GPUs that name
    # no device file ("Removing file-less GPU"), so each is an empty placeholder file; nothing opens them.
    mkdir -p "$STATE_DIR/dev"
    touch "$STATE_DIR"/dev/nvidia{0..3}
    echo "NodeName=$hostlist Name=gpu File=$STATE_DIR/dev/nvidia[0-3]" >"$STATE_DIR/etc/gres.conf"
    # slurmd 22.05 initialises its cgroup plugin even when nothing uses it; point it at an empty dir, or, for
    # task/cgroup, at this machine's cgroup v1 hierarchies (cpuset: the cores).
    if cgroup_cpusets; then
        printf '%s\n' CgroupPlugin=cgroup/v1 CgroupMountpoint=/sys/fs/cgroup CgroupAutomount=no ConstrainCores=yes
        ! cgroup_memory || echo ConstrainRAMSpace=yes
    else
        printf '%s\n' CgroupPlugin=cgroup/v1 "CgroupMountpoint=$STATE_DIR/cgroup-empty" CgroupAutomount=no
    fi >"$STATE_DIR/etc/cgroup.conf"
    # Shifter's SPANK plugin (stand-in): --image is resolved at submission through the local image gateway.
    echo "required $STATE_DIR/spank_shifter_options.so shifterimg=$HERE/shifter/shifterimg gateway=$STATE_DIR/shifter" \
        >"$STATE_DIR/etc/plugstack.conf"
}

build_spank_plugin() {
    local src=$HERE/spank_shifter_options.c so=$STATE_DIR/spank_shifter_options.so
    if [[ ! -f $so || $src -nt $so ]]; then
        gcc -Wall -Werror -shared -fPIC -o "$so" "$src"
    fi
}

# Shifter's network plugin modules (stand-ins of NERSC's aws-ofi-nccl builds for CUDA 12 and 13), in the image
# gateway, where the shifter stand-in mounts them; the stub CUDA runtimes they link go to $STATE_DIR/cudart/MAJOR
# (a test image of that major carries one: tests/test_slurm_ddp.py).
build_site_modules() {
    local major module
    for major in 12 13; do
        module=nccl-plugin
        [[ $major == 12 ]] || module=nccl-cu$major-plugin
        bash "$HERE/nccl_net_plugin/build.sh" "$major" "$STATE_DIR/shifter/modules/$module" "$STATE_DIR/cudart/$major"
    done
}

start_munge() {
    local key=$STATE_DIR/munge-key/munge.key
    [[ -f $key ]] || mungekey --create --keyfile="$key" >/dev/null
    chmod 400 "$key"
    pid_alive "$STATE_DIR/run/munged.pid" && return 0
    munged --force --key-file="$key" --socket="$STATE_DIR/munge/munge.socket.2" \
        --pid-file="$STATE_DIR/run/munged.pid" --log-file="$STATE_DIR/log/munged.log" \
        --seed-file="$STATE_DIR/munge/munged.seed"
}

setup_network() {
    local nodes=$1 i name
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
        ip addr add "$SUBNET.1/24" dev "$BRIDGE"
        ip link set "$BRIDGE" up
    fi
    for ((i = 1; i <= nodes; i++)); do
        name=$(node_name "$i")
        if ! ip netns list | grep -qw "$name"; then
            ip netns add "$name"
            ip link add "${NODE_PREFIX}v$i" type veth peer name eth0 netns "$name"
            ip link set "${NODE_PREFIX}v$i" master "$BRIDGE" up
            ip -n "$name" addr add "$(node_ip "$i")/24" dev eth0
            ip -n "$name" link set eth0 up
            ip -n "$name" link set lo up
            # Deliberately no default route: name lookups that would leave the machine fail at once
            # instead of stalling ~10 s each.
        fi
    done
    # Node names must resolve on every "host"; all namespaces share this /etc/hosts.
    {
        echo "$SUBNET.1 $CONTROLLER_NAME $HOSTS_MARKER"
        for ((i = 1; i <= nodes; i++)); do
            echo "$(node_ip "$i") $(node_name "$i") $HOSTS_MARKER"
        done
    } | edit_hosts
}

# This cluster's lines of /etc/hosts replaced by stdin's, under a lock that both shapes' scripts take (one
# may start while the other stops).
edit_hosts() {
    local lines
    lines=$(cat)
    (
        flock 9
        sed -i "/$HOSTS_MARKER/d" /etc/hosts
        [[ -z $lines ]] || printf '%s\n' "$lines" >>/etc/hosts
    ) 9>/tmp/hpcml-local-slurm-hosts.lock
}

start_daemons() {
    local nodes=$1 i name
    export SLURM_CONF=$STATE_DIR/etc/slurm.conf
    if ! pid_alive "$STATE_DIR/run/slurmctld.pid"; then
        # slurmctld only starts on the host SlurmctldHost names: give it that hostname in a UTS namespace.
        # -c: start from a clean state, with no jobs left over from a last run. Job ids then restart at 1,
        # so the completion log of a last run goes too.
        : >"$STATE_DIR/jobcomp.txt"
        # shellcheck disable=SC2016 # $1/$2 are the inner shell's arguments, expanded there on purpose
        unshare --uts -- sh -c 'hostname "$1" && exec slurmctld -c -f "$2"' sh "$CONTROLLER_NAME" "$SLURM_CONF"
    fi
    for ((i = 1; i <= nodes; i++)); do
        name=$(node_name "$i")
        pid_alive "$STATE_DIR/run/slurmd-$name.pid" && continue
        mkdir -p "$STATE_DIR/spool/$name"
        # Its own network and hostname; slurmd forks into the background and its jobs inherit both.
        # nsenter, not `ip netns exec`: that one remounts /sys, and without the host's cgroup mounts under
        # /sys/fs/cgroup container runtimes (podman + runc) cannot start containers in the jobs.
        # shellcheck disable=SC2016 # as above
        nsenter --net="/run/netns/$name" unshare --uts -- sh -c 'hostname "$1" && exec slurmd -f "$2" -N "$1"' \
            sh "$name" "$SLURM_CONF"
    done
}

wait_until_idle() {
    local nodes=$1 deadline=$((SECONDS + 60)) idle=0
    while ((SECONDS < deadline)); do
        idle=$(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l || true)
        ((idle == nodes)) && return 0
        sleep 1
    done
    log "only $idle of $nodes nodes became idle within 60 s"
    sinfo -N -l >&2 || true
    tail -n 20 "$STATE_DIR"/log/*.log >&2 || true
    return 1
}

cmd_start() {
    local nodes=${1:-${LOCAL_SLURM_NODES:-6}}
    [[ $nodes =~ ^[1-9][0-9]?$ ]] || die "NODES must be 1..99, got '$nodes'"
    [[ $(id -u) == 0 ]] || die "needs root (network namespaces, /etc/hosts)"
    [[ $CRED_EXPIRE =~ ^[1-9][0-9]*$ ]] || die "LOCAL_SLURM_CRED_EXPIRE must be seconds, got '$CRED_EXPIRE'"
    local shape="$nodes nodes, requeue hold ${CRED_EXPIRE}s"
    ! cgroup_memory || shape+=", memory allocated"
    if [[ -f $STATE_DIR/shape ]] && [[ $(cat "$STATE_DIR/shape") != "$shape" ]]; then
        log "cluster has $(cat "$STATE_DIR/shape"), $shape asked for: restarting"
        cmd_stop
    fi
    if cmd_status >/dev/null 2>&1; then
        log "already running ($nodes nodes) under $STATE_DIR"
        return 0
    fi
    cmd_stop >/dev/null 2>&1 || true   # clear half-started leftovers
    ensure_packages
    write_configs "$nodes"
    echo "$shape" >"$STATE_DIR/shape"
    build_spank_plugin
    build_site_modules
    start_munge
    setup_network "$nodes"
    start_daemons "$nodes"
    wait_until_idle "$nodes"
    log "up: $nodes nodes $(node_name 1)..$(node_name "$nodes"), state in $STATE_DIR"
}

cmd_stop() {
    local name pidfile
    # Job processes first: everything running inside a node's network namespace belongs to that node.
    for name in $(ip netns list 2>/dev/null | awk -v prefix="^${NODE_PREFIX}[0-9]+$" '$1 ~ prefix {print $1}'); do
        ip netns pids "$name" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    done
    for pidfile in "$STATE_DIR"/run/slurmd-*.pid "$STATE_DIR/run/slurmctld.pid" "$STATE_DIR/run/munged.pid"; do
        [[ -f $pidfile ]] || continue
        kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    sleep 1
    for pidfile in "$STATE_DIR"/run/*.pid; do
        [[ -f $pidfile ]] || continue
        kill -9 "$(cat "$pidfile")" 2>/dev/null || true
        rm -f "$pidfile"
    done
    for name in $(ip netns list 2>/dev/null | awk -v prefix="^${NODE_PREFIX}[0-9]+$" '$1 ~ prefix {print $1}'); do
        ip netns del "$name" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    SHIFTER_GATEWAY_DIR=$STATE_DIR/shifter bash "$HERE/shifter/shifterimg" release-all 2>/dev/null || true
    edit_hosts </dev/null
    rm -f "$STATE_DIR/shape"
    log "stopped"
}

cmd_status() {
    local nodes
    [[ -f $STATE_DIR/shape ]] || { echo "not running"; return 1; }
    nodes=$(cut -d' ' -f1 "$STATE_DIR/shape")
    pid_alive "$STATE_DIR/run/munged.pid" || { echo "munged not running"; return 1; }
    pid_alive "$STATE_DIR/run/slurmctld.pid" || { echo "slurmctld not running"; return 1; }
    local i
    for ((i = 1; i <= nodes; i++)); do
        pid_alive "$STATE_DIR/run/slurmd-$(node_name "$i").pid" || { echo "slurmd on $(node_name "$i") not running"; return 1; }
    done
    SLURM_CONF=$STATE_DIR/etc/slurm.conf sinfo -N
}

case ${1:-} in
start)
    shift
    # One start at a time (the tests' parallel workers each ask for the cluster): the second one waits,
    # then finds it running. flock -o: the lock is the flock process's own, so the daemons this start
    # leaves running do not inherit it (they would hold it for as long as they live).
    if [[ -z ${LOCAL_SLURM_START_LOCKED:-} ]]; then
        LOCAL_SLURM_START_LOCKED=1 exec flock -o "$STATE_DIR.lock" bash "${BASH_SOURCE[0]}" start "$@"
    fi
    cmd_start "$@"
    ;;
stop) cmd_stop ;;
status) cmd_status ;;
env) echo "export SLURM_CONF=$STATE_DIR/etc/slurm.conf" ;;
*) echo "usage: $0 start [NODES] | stop | status | env" >&2; exit 2 ;;
esac
