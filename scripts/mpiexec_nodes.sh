#!/usr/bin/env bash
# mpiexec_nodes.sh: runs an MPI job as if on NODES machines of RANKS_PER_NODE ranks each, on
# this one machine, with MPICH's hydra:
#   scripts/mpiexec_nodes.sh NODES RANKS_PER_NODE [--] COMMAND [ARGS...]
#   scripts/mpiexec_nodes.sh --check   (exit 0 when it can run here; else says why, exit 2)
# Each pretend node is a hostname (shardopt-node0, shardopt-node1, ...): hydra's ssh launcher
# starts one proxy per host through scripts/fake_ssh.sh, which runs it under `unshare --uts`
# with that hostname. MPICH groups ranks into nodes by hostname, so MPI_COMM_TYPE_SHARED,
# shardopt's node topology and the hierarchical communicator see NODES nodes; ranks are placed
# in blocks (node k holds ranks k*RANKS_PER_NODE ...). The proxies connect back to mpiexec on
# 127.0.0.1 (-localhost), and the pretend hostnames are never resolved (one that resolves to a
# local address would make hydra start that proxy without the launcher), so nothing leaves the
# machine. MPICH's ch4:ucx (Debian's build) still moves the bytes between pretend nodes through
# UCX's own shared-memory transports unless UCX_TLS says otherwise (docs/architecture.md,
# "Several nodes"). The environment is passed on to every rank (hydra's default, -genvall).
# Needs root (unshare --uts) and MPICH's hydra mpiexec ($MPIEXEC, else mpiexec on PATH).
# Extra mpiexec options: SHARDOPT_NODES_MPIEXEC_FLAGS (split on spaces).
set -euo pipefail
usage() {
  echo "usage: mpiexec_nodes.sh NODES RANKS_PER_NODE [--] COMMAND [ARGS...]" >&2
  exit 2
}
die() {
  echo "mpiexec_nodes.sh: $*" >&2
  exit 2
}
# What this machine must have; says what is missing.
check() {
  [ "$(id -u)" -eq 0 ] || die "needs root: each pretend node is a UTS namespace (unshare --uts)"
  command -v unshare > /dev/null || die "unshare not found (Debian: util-linux)"
  unshare --uts true 2> /dev/null || die "unshare --uts fails here: $(unshare --uts true 2>&1)"
  [ -n "$mpiexec" ] || die "mpiexec not found (set MPIEXEC)"
  local version
  version=$("$mpiexec" --version 2>&1 || true)
  [[ "$version" == *HYDRA* ]] || die "$mpiexec is not MPICH's hydra (needed for -launcher-exec)"
}
mpiexec=${MPIEXEC:-$(command -v mpiexec || true)}
if [ "${1:-}" = "--check" ]; then
  check
  exit 0
fi
[ $# -ge 3 ] || usage
nodes=$1
per_node=$2
shift 2
[ "${1:-}" = "--" ] && shift
[ $# -ge 1 ] || usage
[[ "$nodes" =~ ^[1-9][0-9]*$ ]] || die "NODES '$nodes': expected a count >= 1"
[[ "$per_node" =~ ^[1-9][0-9]*$ ]] || die "RANKS_PER_NODE '$per_node': expected a count >= 1"
check
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
hosts=""
for ((k = 0; k < nodes; ++k)); do
  hosts+="${hosts:+,}shardopt-node$k:$per_node"
done
# shellcheck disable=SC2086  # the extra flags are words
exec "$mpiexec" -launcher ssh -launcher-exec "$here/fake_ssh.sh" -localhost 127.0.0.1 \
  -hosts "$hosts" -n $((nodes * per_node)) ${SHARDOPT_NODES_MPIEXEC_FLAGS:-} "$@"
