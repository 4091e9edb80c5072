"""Conversation affinity as a Ray Serve request router (`request_router_config` of the
replicas' deployment): a conversation's requests go to the replica that served it before.

The router reads a request's conversation key from its session id (Ray's `x-session-id`
header, set by the client or derived from the body in Ray's proxy: quasar.server.affinity).
Its home replica is the one this router last sent the key to, else the replica the key
hashes to (rendezvous hashing over the live replicas, so every proxy of a cluster picks the
same one and a replica leaving moves only its own conversations). The home is offered
first and the others after it; Ray sends the request to the first offered replica with room
(its max_ongoing_requests), the least loaded of the others when the home has none. A home
is not preferred when it has `affinity_limit` requests in flight already (what it last
reported, or what this router has sent and offered it since, whichever is more), or when
this router has more than `affinity_slack` requests in flight on it beyond its fewest on any
replica: the request goes to the least loaded replica, which becomes the home. The slack keeps conversations from piling onto a few
replicas while others idle, which cost more throughput than their warm state gave back.
Requests without a key are routed by power of two choices, as Ray's default router does.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import OrderedDict, defaultdict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# A home is chosen while it has at most one request in flight more than the least busy replica:
# Ray reports a request complete after its client has the reply, so a conversation's next turn
# can find its home still counting the turn before.
DEFAULT_SLACK = 1
DEFAULT_REMEMBERED = 100_000  # conversations whose replica a router keeps (least recently used go first)
OFFER_TTL_S = 10.0  # an offer not sent by then was cancelled or rerouted: it no longer counts


def rendezvous_score(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest(), "big")


class ConversationRouter(RequestRouter):
    def initialize_state(self, affinity_limit: int = 8, affinity_slack: int = DEFAULT_SLACK,
                         remembered: int = DEFAULT_REMEMBERED, **_):
        self.affinity_limit = max(1, int(affinity_limit))
        self.affinity_slack = max(0, int(affinity_slack))
        self.remembered = max(1, int(remembered))
        self._homes: OrderedDict[str, ReplicaID] = OrderedDict()  # key -> the replica last sent it
        # What this router has in flight, to see a replica fill before its reports say so:
        # requests sent and not completed, and requests offered to a replica and not sent yet.
        self._sent: defaultdict[ReplicaID, int] = defaultdict(int)
        self._offered: dict[str, tuple[ReplicaID, float]] = {}  # internal request id -> (replica, when)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # no locality pass: back off when all are full
        key = pending_request.metadata.session_id if pending_request is not None else ""
        if not key:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        home = self.home(key, candidate_replicas)
        # balance by what this router itself has in flight (exact for its own requests); a
        # replica's reported queue length can be a burst old and would send a conversation away
        least = min(self.in_flight(r) for r in candidate_replicas)
        if self.load(home) < self.affinity_limit and self.in_flight(home) <= least + self.affinity_slack:
            ranks = [[home], [r for r in candidate_replicas if r.replica_id != home.replica_id]]
        else:  # the least loaded first, by what this router knows
            ranks = [[r] for r in sorted(candidate_replicas, key=self.load)]
        self._offer(pending_request, ranks[0][0])
        return [rank for rank in ranks if rank]

    def home(self, key: str, candidates: list[RunningReplica]) -> RunningReplica:
        """The replica `key` went to last, while it lives; else the one it hashes to."""
        last = self._homes.get(key)
        for replica in candidates:
            if replica.replica_id == last:
                return replica
        return max(candidates, key=lambda r: rendezvous_score(key, r.replica_id.unique_id))

    def in_flight(self, replica: RunningReplica) -> int:
        """Requests this router has sent `replica` and not seen completed, or offered it and not sent yet."""
        rid, now = replica.replica_id, time.monotonic()
        offered = sum(1 for r, t in self._offered.values() if r == rid and now - t < OFFER_TTL_S)
        return self._sent[rid] + offered

    def load(self, replica: RunningReplica) -> int:
        """Requests in flight on `replica`: what it last reported, or what this router sent and
        offered it since, whichever is more."""
        return max(self.replica_queue_len_cache.get(replica.replica_id) or 0, self.in_flight(replica))

    def _offer(self, pending_request: PendingRequest, replica: RunningReplica) -> None:
        if len(self._offered) > 10_000:  # cancelled before they were sent
            now = time.monotonic()
            self._offered = {k: v for k, v in self._offered.items() if now - v[1] < OFFER_TTL_S}
        self._offered[pending_request.metadata.internal_request_id] = (replica.replica_id, time.monotonic())

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._sent[replica_id] += 1

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._offered.pop(pending_request.metadata.internal_request_id, None)
        key = pending_request.metadata.session_id
        if key:
            self._homes[key] = replica_id
            self._homes.move_to_end(key)
            while len(self._homes) > self.remembered:
                self._homes.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._offered.pop(internal_request_id, None)
        if self._sent.get(replica_id, 0) > 0:
            self._sent[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sent.pop(replica_id, None)


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn, whatever its conversation (then the others,
    when that one is full): the baseline scripts/tools/ray_bench.py measures affinity against."""

    def initialize_state(self, **_):
        self._turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        i = self._turn % len(ordered)
        self._turn += 1
        return [[ordered[i]], ordered[i + 1:] + ordered[:i]]
