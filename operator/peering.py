"""Leader election among operator replicas, on kopf peering.

Every replica started with a peering name (``KVPILOT_PEERING``) writes a keep-alive
``{priority, lifetime, lastseen}`` into the status of one ClusterKopfPeering (cluster-wide
operator) or KopfPeering (one per watched namespace), and kopf pauses a replica while a
live peer with a higher priority exists. kopf also pauses *all* replicas that see a live
peer of *equal* priority, so priorities must differ: here the replica started first gets
the highest one (the current leader keeps leading through a rollout, and a crash-looping
new pod never takes over), and a random tie-break keeps two replicas started in the same
millisecond apart. A replica that stops cleanly withdraws its keep-alive, so the next one
takes over at once; one that crashes is taken over once its keep-alive expires
(``KVPILOT_PEERING_LIFETIME``).
"""

from __future__ import annotations

import random

_TIME_BITS = 43    # milliseconds since 1970 fit until the year 2248
_TIE_BITS = 10     # 43 + 10 bits: every priority is an exact integer in JSON (< 2**53)


def peering_priority(started_at: float, tiebreak: int | None = None) -> int:
    """The kopf peering priority of a replica started at ``started_at`` (Unix seconds).

    Earlier starts get higher priorities; ``tiebreak`` (default: random, 0..1023) orders
    replicas started in the same millisecond.
    """
    if tiebreak is None:
        tiebreak = random.randrange(1 << _TIE_BITS)
    if not 0 <= tiebreak < 1 << _TIE_BITS:
        raise ValueError(f"tiebreak must be in [0, {1 << _TIE_BITS}), got {tiebreak}")
    age_rank = (1 << _TIME_BITS) - 1 - int(started_at * 1000)
    if age_rank < 0:
        raise ValueError(f"start time {started_at} is beyond the priority's range")
    return (age_rank << _TIE_BITS) | tiebreak
