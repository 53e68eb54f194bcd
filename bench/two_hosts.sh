# Two "hosts" on this machine for the data-parallel benchmarks: network namespaces $a and $b
# joined by a veth pair (va$$ in $a at $subnet.1, vb$$ in $b at $subnet.2), removed when the
# script exits. Sourced, as root, after setting `subnet` (10.x.y); sets `a`, `b` and an EXIT trap
# that also runs `extra_cleanup` if the script defines it.
a=gpta$$ b=gptb$$
two_hosts_cleanup() {
  ip netns del "$a" 2>/dev/null || true
  ip netns del "$b" 2>/dev/null || true
  if declare -F extra_cleanup >/dev/null; then extra_cleanup; fi
}
trap two_hosts_cleanup EXIT
ip netns add "$a"
ip netns add "$b"
ip link add "va$$" type veth peer name "vb$$"
ip link set "va$$" netns "$a"
ip link set "vb$$" netns "$b"
ip -n "$a" addr add "$subnet.1/24" dev "va$$"
ip -n "$b" addr add "$subnet.2/24" dev "vb$$"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "va$$" up
ip -n "$b" link set "vb$$" up
