#!/usr/bin/env bash
# fake_ssh.sh: the "ssh" that scripts/mpiexec_nodes.sh gives MPICH's hydra (-launcher ssh
# -launcher-exec). Hydra calls it as `fake_ssh.sh [ssh options] HOST COMMAND...` (MPICH 4.0:
# `-x HOST "/usr/bin/hydra_pmi_proxy" --control-port ...`); like ssh, it joins COMMAND into one
# shell command line. It runs that command on this machine in a UTS namespace of its own whose
# hostname is HOST, so every process it starts (hydra's proxy and its ranks) reports HOST, and
# MPICH, which groups ranks into nodes by hostname, sees HOST as a node of its own. Needs root
# (unshare --uts); nothing leaves the machine.
set -euo pipefail
while [ $# -gt 0 ]; do
  case "$1" in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;  # ssh options that take a value
    -*) shift ;;
    *) break ;;
  esac
done
if [ $# -lt 2 ]; then
  echo "fake_ssh.sh: usage: fake_ssh.sh [ssh options] HOST COMMAND..." >&2
  exit 255
fi
host=$1
shift
exec unshare --uts /bin/sh -c 'hostname "$1" && exec /bin/sh -c "$2"' fake_ssh "$host" "$*"
