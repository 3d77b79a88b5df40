"""Membership tuning profiles: `lan`, `wan` and `local`.

Every field below is a trade-off between how fast the swarm notices a change
and how much it costs (bandwidth, false alarms). The defaults follow
hashicorp/memberlist's measured profiles where they are good, and depart
from them where the swarm's needs differ; each departure says why.

The time a crashed node takes to be declared dead everywhere is bounded by
`MembershipConfig.detection_bound(n)`; tests and the demo rely on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class MembershipConfig:
    name: str

    probe_interval: float
    """Seconds between probes of one member (round-robin over all members).

    Shorter finds crashes sooner but costs one ping and ack per interval per
    node. Scaled up by the local-health multiplier when we are unwell."""

    probe_timeout: float
    """Seconds to wait for a direct ack before asking helpers to probe.

    Must exceed the network's round-trip time at its 99th percentile, or
    healthy nodes get indirect probes (cost) and suspicions (noise)."""

    indirect_checks: int
    """Helpers asked to probe a target that missed its direct ack.

    More helpers make a false suspicion under packet loss less likely: with
    10% loss each indirect path (four hops) fails with ~34% chance, three all
    fail with ~4%, four with ~1.4%. memberlist asks three; we ask four on
    LAN, because every false suspicion costs a suspect and a refutation sent
    ~4*log10(N) times by every node: at 10,000 nodes and 10% loss that
    gossip is most of the bandwidth (measured: 63 KB/s per node with three
    helpers), while one more helper costs four small messages per failed
    direct probe."""

    gossip_interval: float
    """Seconds between gossip rounds (only when there is something to send)."""

    gossip_fanout: int
    """Random members each gossip round goes to. Fanout 3 with 200 ms rounds
    is memberlist's LAN setting; the spread time grows as log(N)/log(fanout)."""

    retransmit_mult: int
    """Each update is sent retransmit_mult * ceil(log10(N + 1)) times by every
    node that holds it; enough that all N nodes get it with high probability."""

    suspicion_mult: int
    """Minimum suspicion timeout = suspicion_mult * max(1, log10 N) * probe_interval.

    memberlist uses 4 (12 s at 1,000 nodes). We use 3 on LAN: refutations
    reach a suspect within ~2 gossip hops of a second, so 9 s still leaves a
    wide margin, and detection gets ~3 s faster (target: median <= 15 s)."""

    suspicion_max_timeout_mult: int
    """A suspicion starts at max = this * min and falls toward min as other
    members independently confirm it (Lifeguard): a lone accuser whose own
    links are bad cannot get a healthy node declared dead quickly."""

    push_pull_interval: float
    """Seconds between state syncs with one random member, scaled by
    ceil(log2 N - 5) + 1 above 32 nodes so total sync traffic stays flat.
    It repairs whatever gossip missed (e.g. updates that aged out). A sync
    compares digests and trades only the entries the two hold differently
    (`mesh.sync`), so one between members that agree costs a digest."""

    awareness_max_multiplier: int
    """Lifeguard local health: when our own probes go unanswered without
    nacks, we are probably the slow one, so probe timeouts and intervals grow
    up to this factor instead of accusing healthy peers."""

    gossip_to_dead_time: float
    """Keep gossiping to a member this long after it was declared dead, so a
    falsely declared node hears of it and refutes."""

    reconnect_interval: float
    """Every this many seconds, ping one random dead (not departed) member;
    an answer triggers a state sync. This is what heals a partition:
    after it, each side thinks the other is dead and would never talk to it
    again otherwise (serf does the same with its reconnect loop)."""

    reconnect_timeout: float
    """Stop trying to reach a dead member after this long; its entry is then
    forgotten. Departed (left) members are forgotten after the same time."""

    packet_budget: int
    """Bytes of piggybacked updates per message (estimated).

    memberlist keeps packets under one 1,400-byte UDP datagram; our control
    plane is ZeroMQ over TCP, so there is no fragmentation to avoid. A budget
    several records wide keeps a 1 KiB node record from starving behind a
    stream of small suspicion/refutation updates under loss; total bytes do
    not grow, since each update is still sent the same number of times."""

    join_retry_interval: float
    """Seconds between join attempts while no seed has answered."""

    newcomers_per_address: int
    """New identities one address may bring in per minute (`mesh.newcomers`),
    counted by every node: in membership by the address a newcomer
    advertises, at the handshake by the address it connects from.

    A Sybil bound: a key costs nothing, so one machine can present
    thousands; this makes them arrive slowly (1,000 keys at 4 a minute take
    four hours) while Raft, the ledger and probing keep up. Lower is safer
    against a flood from one host, and slower for honest nodes that share
    an address: a host running many nodes, volunteers behind one NAT or
    CGNAT. A refused newcomer is only delayed: it is learned when the
    bucket refills (gossip retransmits, full-state syncs, its own probes).
    A joiner's first full state from its seed is exempt, or joining a
    large swarm would stall; at the handshake, keys that connected before
    or that membership already learned are never charged again."""

    newcomers_per_prefix: int
    """New identities one /24 (IPv4) or /48 (IPv6) may bring in per minute.

    The same bound one level up: an attacker with a subnet of addresses
    gets this many, not `newcomers_per_address` times 256. Lower is safer;
    higher lets a rack, a lab subnet or a cloud region full of honest
    volunteers join faster."""

    introductions_per_member: int
    """New ids one member may introduce to this node per minute
    (`mesh.newcomers.IntroductionLimit`): ids it tells us of that we did
    not know, counted by the authenticated sender, whatever addresses the
    ids advertise (the per-address and per-prefix bounds do not stop one
    admitted key that gives each made-up id its own /24). An id that
    introduces itself is charged to itself.

    Lower is safer against one admitted key flooding the member list, and
    slower for an honest member that is the first to hear of many
    joiners at once (a seed): the ids it may not introduce now reach us
    from the other members that relay them, from full-state syncs, or
    from the joiners themselves, once budgets allow."""

    introductions_total: int
    """New ids this node learns per minute from all introducers together:
    the bound when several admitted keys collude, and on the work a flood
    costs (a signature check and one probe per id). Lower is safer; higher
    lets a swarm grow faster (a node learns at most this many newcomers a
    minute, beyond the ones its join's seed taught it). An id introduced
    is still not alive until it is verified (`vouches_to_verify`)."""

    vouches_to_verify: int
    """Independent alive members whose relay of a new id's Alive verifies
    it without our own probe. A new id is not alive (not routable, not
    counted) until it answered our own direct ping, or this many members
    told us of it. Honest members gossip an id only once they verified it
    themselves, so each relay is one member's word that it did. One
    admitted key is one voice: at 2 or more it cannot verify its own
    inventions; more is safer against colluding keys, and slower for an
    honest newcomer that we cannot ping directly (a one-way link)."""

    # --- protocol switches -------------------------------------------------
    # Parts of the protocol a researcher can turn off (or, for eager gossip,
    # on) to measure what each is worth. Every profile runs with the
    # defaults: Lifeguard whole, as memberlist does, plus our direct
    # refutation; switching all four Lifeguard parts off is plain SWIM.

    local_health: bool = True
    """Lifeguard's local health (LHA-probe): a node whose probes go
    unanswered slows its own probing (`awareness_max_multiplier`). Off, a
    node with bad links of its own accuses healthy members at full speed."""

    dynamic_suspicion: bool = True
    """Lifeguard's LHA-suspicion: a suspicion starts long and shrinks as
    others confirm it. Off, every suspicion lasts the minimum timeout, as in
    SWIM: faster verdicts on real crashes, and more false ones under loss."""

    nacks: bool = True
    """Lifeguard's nacks: a helper that cannot reach the target says so, and
    the asker counts only silent helpers against its own health. Off, no
    Nack is sent and a failed probe counts once against the asker."""

    buddy: bool = True
    """Lifeguard's buddy system: a probe of a suspect carries the suspicion,
    so the suspect can refute at once rather than when gossip reaches it."""

    refute_to_accuser: bool = True
    """A refutation also goes straight to the accuser (not in memberlist):
    the member most likely to declare us dead hears of it first."""

    eager_gossip: bool = False
    """Gossip news at once instead of at the next round: updates spread a
    round (`gossip_interval`) sooner per hop, for more, smaller gossip
    messages (a burst of news costs a round per message that brings some)."""

    def __post_init__(self) -> None:
        if self.probe_timeout >= self.probe_interval:
            raise ValueError("probe_timeout must be shorter than probe_interval")
        for field_name in (
            "probe_interval",
            "gossip_interval",
            "push_pull_interval",
            "reconnect_interval",
        ):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"{field_name} must be positive")
        if self.gossip_fanout < 1 or self.retransmit_mult < 1 or self.suspicion_mult < 1:
            raise ValueError("fanout, retransmit_mult and suspicion_mult must be >= 1")
        if self.newcomers_per_address < 1 or self.newcomers_per_prefix < 1:
            raise ValueError("newcomers_per_address and newcomers_per_prefix must be >= 1")
        if self.introductions_per_member < 1 or self.introductions_total < 1:
            raise ValueError("introductions_per_member and introductions_total must be >= 1")
        if self.vouches_to_verify < 1:
            raise ValueError("vouches_to_verify must be >= 1")

    # --- profiles -----------------------------------------------------------

    @classmethod
    def lan(cls) -> MembershipConfig:
        """One building or data centre: sub-millisecond to few-ms round trips."""
        return cls(
            name="lan",
            probe_interval=1.0,
            probe_timeout=0.5,
            indirect_checks=4,
            gossip_interval=0.2,
            gossip_fanout=3,
            retransmit_mult=4,
            suspicion_mult=3,
            suspicion_max_timeout_mult=6,
            push_pull_interval=30.0,
            awareness_max_multiplier=8,
            gossip_to_dead_time=30.0,
            reconnect_interval=10.0,
            reconnect_timeout=24 * 3600.0,
            packet_budget=8 * 1024,
            join_retry_interval=1.0,
            # A lab may start dozens of nodes on one host (one per GPU, or a
            # test rig), and a /24 is one rack or lab subnet: 64 and 256 a
            # minute let all of them in at once while a flood from one host
            # still needs 16 minutes for 1,000 keys.
            newcomers_per_address=64,
            newcomers_per_prefix=256,
            # A lab host starting 40 nodes at once is 40 new ids a minute at
            # every node, most relayed by the seed: 64 lets them in, while
            # one admitted key needs 16 minutes to bring in 1,000. A node
            # learns at most 256 a minute in all, four such bursts.
            introductions_per_member=64,
            introductions_total=256,
            vouches_to_verify=3,
        )

    @classmethod
    def wan(cls) -> MembershipConfig:
        """Volunteers across the internet: 40-300 ms round trips, more loss.

        The probe and suspicion timings were measured in the WAN lab, not
        guessed: `python -m benchmarks.wan_profile` ran five real nodes in
        five lab sites for each of four candidates side by side, at 40 ms
        RTT with 1% loss and 100 ms with 3% (7 minutes each), and at 300 ms
        with 1% (`--case 300:0.01`, 5 minutes), then SIGKILLed one node.
        These are the fastest that took no live node for dead and raised
        few false suspicions in every case (docs/benchmarks.md#wan_profile
        has the table; `detection_bound(5)` is 73 s, 235 s before). The
        lab's links have a steady delay and independent losses: a real home
        link's stalls (Wi-Fi, a saturated uplink) are not in these figures,
        and local health (`awareness_max_multiplier`) is what slows the
        probing of a node whose own links stall. Fanout is higher than
        lan's to make up for loss."""
        return cls(
            name="wan",
            # Measured, kill to dead at every survivor: 12.2 s (40 ms, 1%),
            # 11.1 s (100 ms, 3%), 10.9 s (300 ms, 1%), against 35.6-39.0 s
            # for the guessed 5 s / 3 s / 6 and 19.1-19.8 s for 3 s / 1.5 s / 5.
            probe_interval=2.0,
            # Measured: 1 s raised one false suspicion in 27.6 node-minutes
            # at 300 ms RTT and none at 40 or 100 ms (refuted; no false
            # death). lan's 0.5 s (with a 1 s interval) raised 31 at 300 ms,
            # 1.1 per node-minute: a lost packet's TCP retransmission plus
            # a 300 ms round trip outlasts it.
            probe_timeout=1.0,
            indirect_checks=3,
            gossip_interval=0.5,
            gossip_fanout=4,
            retransmit_mult=4,
            # Measured with the probe timings above: no false death in 102
            # node-minutes over the three cases. The minimum suspicion is
            # 8 s at 5 nodes (24 s at 1,000), ample for a refutation that
            # reaches the accuser in one round trip.
            suspicion_mult=4,
            suspicion_max_timeout_mult=6,
            push_pull_interval=60.0,
            awareness_max_multiplier=8,
            gossip_to_dead_time=60.0,
            reconnect_interval=30.0,
            reconnect_timeout=24 * 3600.0,
            packet_budget=8 * 1024,
            join_retry_interval=2.0,
            # On the internet one address is one volunteer's machine or
            # home; a few nodes each is plenty. Volunteers behind one NAT
            # or CGNAT, or many in one cloud subnet, join 4 (16) a minute.
            newcomers_per_address=4,
            newcomers_per_prefix=16,
            # Volunteers arrive one by one; a swarm that grows by 64 a
            # minute at every node is a fast-growing one, and one admitted
            # key gets 16 a minute in, none of them alive unless it answers.
            introductions_per_member=16,
            introductions_total=64,
            vouches_to_verify=3,
        )

    @classmethod
    def local(cls) -> MembershipConfig:
        """One machine (loopback): tests and the demo.

        Everything is fast because loopback neither loses nor delays; a
        crashed process is declared dead in a few seconds."""
        return cls(
            name="local",
            probe_interval=0.3,
            probe_timeout=0.1,
            indirect_checks=2,
            gossip_interval=0.05,
            gossip_fanout=3,
            retransmit_mult=3,
            suspicion_mult=3,
            suspicion_max_timeout_mult=4,
            push_pull_interval=5.0,
            awareness_max_multiplier=4,
            gossip_to_dead_time=10.0,
            reconnect_interval=1.0,
            reconnect_timeout=3600.0,
            packet_budget=64 * 1024,
            join_retry_interval=0.3,
            # Loopback: every node of a local swarm is 127.0.0.1, and tests
            # and the demo start up to a dozen real nodes within seconds
            # (simulated nodes have addresses of their own). lan's 64 a
            # minute is far above that, and keeps a flood of keys from one
            # process as slow here as on a LAN: a thousand new members at
            # once stall every node's event loop for about a second, long
            # enough for a needless election at this profile's timeouts.
            newcomers_per_address=64,
            newcomers_per_prefix=256,
            # Tests start up to a dozen nodes (forty in the core's tests)
            # within seconds: 64 a minute from one member lets them in. A
            # flooding key is held to 64 a minute (none alive unless it
            # answers our ping at the address it advertises). Local swarms
            # have three or four nodes, so two vouches is most of them.
            introductions_per_member=64,
            introductions_total=256,
            vouches_to_verify=2,
        )

    @classmethod
    def profile(cls, name: str) -> MembershipConfig:
        factories = {"lan": cls.lan, "wan": cls.wan, "local": cls.local}
        try:
            return factories[name]()
        except KeyError:
            choices = ", ".join(sorted(factories))
            raise ValueError(f"unknown profile {name!r}; choose one of {choices}") from None

    def with_overrides(self, **changes: Any) -> MembershipConfig:
        return replace(self, **changes)

    # --- derived quantities -------------------------------------------------

    def retransmit_limit(self, n: int) -> int:
        return self.retransmit_mult * math.ceil(math.log10(n + 1))

    def suspicion_min_timeout(self, n: int) -> float:
        return self.suspicion_mult * max(1.0, math.log10(max(n, 1))) * self.probe_interval

    def suspicion_max_timeout(self, n: int) -> float:
        return self.suspicion_max_timeout_mult * self.suspicion_min_timeout(n)

    def suspicion_confirmations(self, n: int) -> int:
        """Independent confirmations that bring a suspicion down to its minimum."""
        return max(0, min(self.suspicion_mult - 2, n - 2))

    def push_pull_period(self, n: int) -> float:
        if n <= 32:
            return self.push_pull_interval
        return self.push_pull_interval * (math.ceil(math.log2(n) - 5) + 1)

    def detection_bound(self, n: int) -> float:
        """Worst case seconds from a crash to `dead` at every surviving member.

        Each survivor probes members round-robin in an order it reshuffles
        every cycle, so it reaches any given member within 2 * (n - 1) probe
        intervals. Add one interval for the failed probe, the maximum
        suspicion timeout (as if nobody confirmed it), and the spread of the
        `dead` update. Typical detection is far sooner: all n - 1 survivors
        probe, and confirmations shrink the timeout to its minimum. Assumes
        healthy survivors (local-health multiplier at 1).
        """
        first_probe = 2 * max(n - 1, 1) * self.probe_interval
        failed_probe = self.probe_interval
        spread = 10 * self.gossip_interval + self.probe_interval
        return first_probe + failed_probe + self.suspicion_max_timeout(n) + spread
