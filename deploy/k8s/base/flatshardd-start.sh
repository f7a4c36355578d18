# flatshardd's container command: `sh flatshardd-start.sh FLAG...` (daemonset.yaml).
#
# Shard memory is charged to the daemon's container. Segments are POSIX shm in the node's
# /dev/shm (tmpfs, hostIPC), and a tmpfs page is charged to the memory cgroup of the process
# that first allocates it: flatshardd fallocate()s every segment it creates, so all shards and
# buffers count against this container's limits.memory, not the trainers' (whose mappings of
# the same pages add nothing), and stay charged to it until they are freed. A limit below
# what --memory_limit_mib lets the daemon allocate means the kernel OOM-kills it instead of the
# daemon refusing an allocation with RESOURCE_EXHAUSTED.
#
# So limits.memory is the one number to set: FLATSHARD_CONTAINER_MEMORY_MIB is that limit
# (downward API, in MiB), FLATSHARD_DAEMON_OVERHEAD_MIB the daemon's own memory (heap, gRPC,
# UCX, CUDA contexts, page cache of the state records), and the rest is --memory_limit_mib.
set -eu
limit_mib=${FLATSHARD_CONTAINER_MEMORY_MIB:?set from limits.memory (resourceFieldRef, divisor 1Mi)}
overhead_mib=${FLATSHARD_DAEMON_OVERHEAD_MIB:?MiB of memory the daemon needs besides shards}
shard_mib=$((limit_mib - overhead_mib))
if [ "$shard_mib" -le 0 ]; then
  echo "flatshardd-start.sh: limits.memory (${limit_mib} MiB) leaves nothing for shards after" \
       "FLATSHARD_DAEMON_OVERHEAD_MIB (${overhead_mib} MiB): raise limits.memory" >&2
  exit 1
fi
exec /usr/local/bin/flatshardd "$@" --memory_limit_mib="$shard_mib"
