"""Live recovery (`dataparallel train --recovery live`): a run that loses, gains or lets go of
replicas while it trains, and goes on without a restart. Its files, by side, each importing only
the files listed before it:

    shared         membership.py  who trains in the next generation: the quorum's rule, pure
                   store.py       the launcher's store: where it is, how to reach it, every key
                   quorum.py      reports in, one decision out, through the store
                   requests.py    joins and leaves asked from outside the launcher
                   remote.py      a joiner's heartbeat, and the launcher's handle on it
    the launcher   launcher.py    starts, watches and replaces the replicas; decides
    the worker     replica.py     an HSDP replica's S processes: their places and their vote
                   groups.py      the process groups a replica talks through, and left
                   rewind.py      what a failed step goes back to, what a heal sends
                   recovery.py    the guarded steps: rewind, regroup, heal, redo

The commands `dataparallel join` and `leave` (train/elastic.py) stand above the worker they run.
Its notes: [Note: live recovery] in recovery.py (start there), [Note: membership] in
membership.py, [Note: quorum keys] in quorum.py, [Note: membership requests] in requests.py,
[Note: HSDP replicas] in replica.py, [Note: abandoned groups] in groups.py, [Note: live
averaging] in rewind.py; [Note: the machine's keeper] in train/elastic.py. docs/faults.md
describes what a run does.
"""
