"""Two hosts on one machine: network namespaces joined by a shaped veth link, and a
`dataparallel train --nnodes 2` run with one node in each.

    sudo python benchmarks/two_hosts.py --rate 100mbit -- --steps 20 --compress int8
    sudo python benchmarks/two_hosts.py --rate 1gbit --out runs/2h -- --diloco 50

Each namespace gets one end of a veth pair (10.77.0.1 and 10.77.0.2), and each end a token
bucket (`tc qdisc ... tbf rate R`) on its egress, so the link carries R each way (netem is not
available here, so there is no added latency). Node 0 runs rank 0 and writes the run; each node
pins gloo to its veth end (GLOO_SOCKET_IFNAME) and the nodes meet at 10.77.0.1. Everything
created is removed on the way out, also when the run fails or is interrupted. Needs root and
`ip netns`; `available()` says whether this machine allows them, and why not. The code is
tests/host_namespaces.py, which the tests share.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from host_namespaces import available, train_on_two_hosts  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="tc tbf rate each way; 'none' unshaped")
    parser.add_argument("--out", default=f"runs/two-hosts-{int(time.time())}")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train flags")
    args = parser.parse_args()
    reason = available()
    if reason:
        print(f"two_hosts: {reason}", file=sys.stderr)
        return 2
    extra = [a for a in args.train_args if a != "--"]
    rate = None if args.rate == "none" else args.rate
    node0, node1, output, seconds = train_on_two_hosts(extra, args.out, rate)
    print(output)
    print(f"two_hosts: nodes exited {node0} and {node1} after {seconds:.1f}s; run in {args.out}")
    return node0 or node1


if __name__ == "__main__":
    raise SystemExit(main())
