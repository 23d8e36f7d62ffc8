"""Live recovery (`dataparallel train --recovery live`): a run that loses, gains or lets go of
replicas while it trains, and goes on without a restart. Its files, by side, each importing only
the files listed before it:

    shared         membership.py  who trains in the next generation: the quorum's rule, pure
                   store.py       the launcher's store: where it is, how to reach it, every key
                   secret.py      the run's secret; requests and reports sealed and checked
                   quorum.py      reports in, one decision out, through the store
                   requests.py    joins and leaves asked from outside the launcher
                   remote.py      a joiner's heartbeat, and the launcher's handle on it
    the launcher   slots.py       what trains in each slot (a child, an HSDP replica's S, a joiner)
                   launcher.py    starts, watches and replaces the replicas; decides
    the worker     replica.py     an HSDP replica's S processes: their places and their vote
                   groups.py      the process groups a replica talks through, and left
                   rewind.py      what a failed step goes back to, what a heal sends
                   recovery.py    the guarded steps: rewind, regroup, heal, redo
    the commands   elastic.py     `dataparallel join` and `leave`: a live run grows or shrinks

One word per concept:
    replica    the failure domain: one process under DDP, the S processes of an HSDP replica;
               it trains, fails, is replaced and healed as a whole (the launcher's handle on
               S children is `Replica`)
    slot       a replica's number in the run: 0..N-1 for the replicas started together, N and
               up for joiners; a replacement takes its predecessor's (`slot` in code; the
               stored Report, Request and Answer and ENV_LIVE keep their JSON name `replica`)
    seat       one process's place in its replica: index i of S (`Seat`)
    generation the members that train together, decided once (`Membership`); a *member* is a
               replica of the current one
    regroup    the members form the next generation: after a failed collective, or asked at a
               step boundary (`RegroupAsked`) to let a replica in or out
    join       a replica asked in from outside the launcher (`dataparallel join`, a JOIN
               request; it is then a *joiner*); not `dp.join`, PyTorch's Join for uneven inputs
               (api.py), nor `dp.regroup`, which forms the next generation's process group
    leave      what a member is asked to do (`dataparallel leave`, a LEAVE request, the LEAVE it
               then reports); granted, it is *released* (`Quorum.released`, `Phase.RELEASED`,
               `Life.RELEASED`, `Released`)
    dropped    left out of a generation for reporting late, stalled (`Dropped`); *lost*: ended
               otherwise than with 0, or silent in its replica's vote (`ReplicaLost`); *gone*:
               a member of the last generation that is not in the next, for any of these
               reasons

The commands `dataparallel join` and `leave` (elastic.py) stand above the worker they run.
The notes: [Note: live recovery] in recovery.py (start there), [Note: membership] in
membership.py, [Note: quorum keys] in quorum.py, [Note: membership requests] in requests.py,
[Note: signed requests] in secret.py, [Note: HSDP replicas] in replica.py, [Note: abandoned
groups] in groups.py, [Note: live averaging] in rewind.py; [Note: the machine's keeper] in
elastic.py. docs/faults.md describes what a run does, docs/security.md what it lets in.
"""
