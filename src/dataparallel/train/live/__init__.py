"""Live recovery (`dataparallel train --recovery live`, `dataparallel join`, `leave`): a run that
loses, gains or lets go of replicas while it trains, and goes on without a restart.

    membership.py  who trains in the next generation: the quorum's rule, pure   [Note: membership]
    quorum.py      the quorum's keys in the launcher's store                    [Note: quorum keys]
    requests.py    joins and leaves asked from outside the launcher    [Note: membership requests]
    remote.py      a joiner's run file, heartbeat, and the launcher's handle on it
    launcher.py    the launcher: starts, watches and replaces the workers, decides
    replica.py     an HSDP replica's S processes: their ranks and vote         [Note: HSDP replicas]
    groups.py      the process groups a replica talks through and left     [Note: abandoned groups]
    rewind.py      what a failed step goes back to, what a heal sends       [Note: live averaging]
    recovery.py    a worker's guarded steps: rewind, regroup, heal, redo      [Note: live recovery]
    elastic.py     `dataparallel join` and `leave`               [Note: the machine's keeper]

Start at [Note: live recovery] in recovery.py; docs/faults.md describes the behaviour.
"""
